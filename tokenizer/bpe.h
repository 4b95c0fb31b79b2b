// Byte-pair encoding core: hash maps from token bytes to ids and from id pairs to merges,
// and the merge loop of Hugging Face tokenizers' BPE model.
//
// Merge loop: the word starts as a list of symbols; the adjacent pair with the lowest merge
// rank is merged first, the leftmost one on a tie (a min-heap keyed by (rank, position) over a
// linked list), until no adjacent pair has a merge. O(n log n) in the word's length.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define BPE_NO_ID UINT32_MAX

// Open-addressing map from byte strings (copied in) to uint32 values.
typedef struct {
    uint64_t *slot_hashes; // 0 = empty
    uint32_t *slot_entries;
    size_t slot_mask;
    unsigned char *bytes;  // the keys, back to back
    size_t bytes_used, bytes_capacity;
    size_t *key_offsets;
    uint32_t *key_lengths, *values;
    size_t count, capacity;
} StringMap;

int string_map_init(StringMap *map, size_t expected_count);
void string_map_free(StringMap *map);
// Inserts key -> value, or overwrites the value of an existing key. 0 ok, -1 out of memory.
int string_map_put(StringMap *map, const unsigned char *key, size_t len, uint32_t value);
// The value of key, or BPE_NO_ID.
uint32_t string_map_get(const StringMap *map, const unsigned char *key, size_t len);

// Open-addressing map from a pair of ids to (rank, id of the merged token).
typedef struct {
    uint64_t *keys; // (left << 32) | right; UINT64_MAX = empty
    uint64_t *values; // (rank << 32) | merged id
    size_t mask, count;
} MergeMap;

int merge_map_init(MergeMap *map, size_t expected_count);
void merge_map_free(MergeMap *map);
// Later merges of the same pair overwrite earlier ones, as in Hugging Face's HashMap.
void merge_map_put(MergeMap *map, uint32_t left, uint32_t right, uint32_t rank, uint32_t merged);
// 1 and *rank, *merged when the pair merges.
int merge_map_get(const MergeMap *map, uint32_t left, uint32_t right, uint32_t *rank, uint32_t *merged);

// Working memory of one merge loop, owned by one caller at a time (so one per thread).
typedef struct {
    struct BpeSymbol *symbols;
    uint64_t *heap;
    size_t symbol_capacity, heap_capacity;
} BpeScratch;

void bpe_scratch_free(BpeScratch *scratch);
// Merges ids[0..*count) in place; *count gets the new length. 0 ok, -1 out of memory.
int bpe_merge(const MergeMap *merges, uint32_t *ids, size_t *count, BpeScratch *scratch);
