// `./tokenize shards`: tokenizes a text corpus into training and validation token shards in
// llm.c's format (dataloader/shard.h). Inputs are text files (one document per file, or split
// at a separator string or at blank lines) and JSONL files (one document per line, its "text"
// field), each also compressed as NAME.gz or NAME.zst (input_file.h); directories are walked
// recursively in sorted order. Documents are tokenized in
// parallel and written in input order, so the shards are the same for any thread count.
#pragma once

// argv[0] is "shards"; returns the process exit status (0 on success) after printing a summary,
// or an "error: ..." line on stderr.
int shards_command(int argc, char **argv);
