// Hash maps and the BPE merge loop; see bpe.h.
#include "bpe.h"

#include <stdlib.h>
#include <string.h>

typedef struct BpeSymbol {
    uint32_t id;      // BPE_NO_ID once merged into its left neighbour
    int64_t prev, next; // -1 at the ends
} BpeSymbol;

// Non-zero hash of a byte string (0 marks an empty slot).
static uint64_t hash_bytes(const unsigned char *s, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, s, 8);
        h = (h ^ word) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        s += 8;
        n -= 8;
    }
    uint64_t tail = 0;
    memcpy(&tail, s, n);
    h = (h ^ tail) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    return h ? h : 1;
}

static size_t table_size_for(size_t count) {
    size_t size = 16;
    while (size < 2 * count) size *= 2;
    return size;
}

int string_map_init(StringMap *map, size_t expected_count) {
    memset(map, 0, sizeof(*map));
    size_t slots = table_size_for(expected_count);
    map->slot_hashes = (uint64_t *)calloc(slots, sizeof(uint64_t));
    map->slot_entries = (uint32_t *)calloc(slots, sizeof(uint32_t));
    if (!map->slot_hashes || !map->slot_entries) { string_map_free(map); return -1; }
    map->slot_mask = slots - 1;
    return 0;
}

void string_map_free(StringMap *map) {
    free(map->slot_hashes);
    free(map->slot_entries);
    free(map->bytes);
    free(map->key_offsets);
    free(map->key_lengths);
    free(map->values);
    memset(map, 0, sizeof(*map));
}

static int string_map_grow_slots(StringMap *map) {
    size_t slots = 2 * (map->slot_mask + 1);
    uint64_t *hashes = (uint64_t *)calloc(slots, sizeof(uint64_t));
    uint32_t *entries = (uint32_t *)calloc(slots, sizeof(uint32_t));
    if (!hashes || !entries) { free(hashes); free(entries); return -1; }
    for (size_t i = 0; i <= map->slot_mask; i++) {
        if (!map->slot_hashes[i]) continue;
        size_t j = map->slot_hashes[i] & (slots - 1);
        while (hashes[j]) j = (j + 1) & (slots - 1);
        hashes[j] = map->slot_hashes[i];
        entries[j] = map->slot_entries[i];
    }
    free(map->slot_hashes);
    free(map->slot_entries);
    map->slot_hashes = hashes;
    map->slot_entries = entries;
    map->slot_mask = slots - 1;
    return 0;
}

static int grow(void **array, size_t *capacity, size_t needed, size_t element_size) {
    if (needed <= *capacity) return 0;
    size_t capacity_new = *capacity ? *capacity : 64;
    while (capacity_new < needed) capacity_new *= 2;
    void *grown = realloc(*array, capacity_new * element_size);
    if (!grown) return -1;
    *array = grown;
    *capacity = capacity_new;
    return 0;
}

int string_map_put(StringMap *map, const unsigned char *key, size_t len, uint32_t value) {
    if (len > UINT32_MAX) return -1;
    uint64_t h = hash_bytes(key, len);
    size_t i = h & map->slot_mask;
    for (; map->slot_hashes[i]; i = (i + 1) & map->slot_mask) {
        uint32_t e = map->slot_entries[i];
        if (map->slot_hashes[i] == h && map->key_lengths[e] == len &&
            memcmp(map->bytes + map->key_offsets[e], key, len) == 0) {
            map->values[e] = value;
            return 0;
        }
    }
    if (map->count == map->capacity) {
        size_t capacity = map->capacity ? 2 * map->capacity : 64;
        size_t *offsets = (size_t *)realloc(map->key_offsets, capacity * sizeof(size_t));
        if (offsets) map->key_offsets = offsets;
        uint32_t *lengths = (uint32_t *)realloc(map->key_lengths, capacity * sizeof(uint32_t));
        if (lengths) map->key_lengths = lengths;
        uint32_t *values = (uint32_t *)realloc(map->values, capacity * sizeof(uint32_t));
        if (values) map->values = values;
        if (!offsets || !lengths || !values) return -1;
        map->capacity = capacity;
    }
    if (grow((void **)&map->bytes, &map->bytes_capacity, map->bytes_used + len + 1, 1)) return -1;
    size_t e = map->count++;
    memcpy(map->bytes + map->bytes_used, key, len);
    map->key_offsets[e] = map->bytes_used;
    map->key_lengths[e] = (uint32_t)len;
    map->values[e] = value;
    map->bytes_used += len;
    map->slot_hashes[i] = h;
    map->slot_entries[i] = (uint32_t)e;
    if (2 * map->count > map->slot_mask + 1) return string_map_grow_slots(map);
    return 0;
}

uint32_t string_map_get(const StringMap *map, const unsigned char *key, size_t len) {
    uint64_t h = hash_bytes(key, len);
    for (size_t i = h & map->slot_mask; map->slot_hashes[i]; i = (i + 1) & map->slot_mask) {
        uint32_t e = map->slot_entries[i];
        if (map->slot_hashes[i] == h && map->key_lengths[e] == len &&
            memcmp(map->bytes + map->key_offsets[e], key, len) == 0)
            return map->values[e];
    }
    return BPE_NO_ID;
}

static size_t pair_slot(uint64_t key, size_t mask) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    return (size_t)(h ^ h >> 32) & mask;
}

int merge_map_init(MergeMap *map, size_t expected_count) {
    size_t slots = table_size_for(expected_count);
    map->keys = (uint64_t *)malloc(slots * sizeof(uint64_t));
    map->values = (uint64_t *)malloc(slots * sizeof(uint64_t));
    if (!map->keys || !map->values) { merge_map_free(map); return -1; }
    memset(map->keys, 0xFF, slots * sizeof(uint64_t));
    map->mask = slots - 1;
    map->count = 0;
    return 0;
}

void merge_map_free(MergeMap *map) {
    free(map->keys);
    free(map->values);
    memset(map, 0, sizeof(*map));
}

// The table is sized for the expected count up front (at most half full), so no growth.
void merge_map_put(MergeMap *map, uint32_t left, uint32_t right, uint32_t rank, uint32_t merged) {
    uint64_t key = (uint64_t)left << 32 | right;
    size_t i = pair_slot(key, map->mask);
    while (map->keys[i] != UINT64_MAX && map->keys[i] != key) i = (i + 1) & map->mask;
    if (map->keys[i] == UINT64_MAX) map->count++;
    map->keys[i] = key;
    map->values[i] = (uint64_t)rank << 32 | merged;
}

int merge_map_get(const MergeMap *map, uint32_t left, uint32_t right, uint32_t *rank, uint32_t *merged) {
    uint64_t key = (uint64_t)left << 32 | right;
    for (size_t i = pair_slot(key, map->mask); map->keys[i] != UINT64_MAX; i = (i + 1) & map->mask) {
        if (map->keys[i] == key) {
            *rank = (uint32_t)(map->values[i] >> 32);
            *merged = (uint32_t)map->values[i];
            return 1;
        }
    }
    return 0;
}

void bpe_scratch_free(BpeScratch *scratch) {
    free(scratch->symbols);
    free(scratch->heap);
    memset(scratch, 0, sizeof(*scratch));
}

// Min-heap of (rank << 32 | position): lowest rank first, then leftmost.
static void heap_push(uint64_t *heap, size_t *size, uint64_t entry) {
    size_t i = (*size)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (heap[parent] <= entry) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = entry;
}

static uint64_t heap_pop(uint64_t *heap, size_t *size) {
    uint64_t top = heap[0], last = heap[--(*size)];
    size_t i = 0, n = *size;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && heap[child + 1] < heap[child]) child++;
        if (last <= heap[child]) break;
        heap[i] = heap[child];
        i = child;
    }
    if (n) heap[i] = last;
    return top;
}

int bpe_merge(const MergeMap *merges, uint32_t *ids, size_t *count, BpeScratch *scratch) {
    size_t n = *count;
    if (n < 2) return 0;
    if (n > UINT32_MAX) return -1;
    // Each merge pushes at most two entries and removes a symbol, so 3n bounds the heap.
    if (grow((void **)&scratch->symbols, &scratch->symbol_capacity, n, sizeof(BpeSymbol))) return -1;
    if (grow((void **)&scratch->heap, &scratch->heap_capacity, 3 * n, sizeof(uint64_t))) return -1;
    BpeSymbol *symbols = scratch->symbols;
    uint64_t *heap = scratch->heap;
    size_t heap_size = 0;
    uint32_t rank, merged;
    for (size_t i = 0; i < n; i++) {
        symbols[i].id = ids[i];
        symbols[i].prev = (int64_t)i - 1;
        symbols[i].next = i + 1 < n ? (int64_t)i + 1 : -1;
        if (i + 1 < n && merge_map_get(merges, ids[i], ids[i + 1], &rank, &merged))
            heap_push(heap, &heap_size, (uint64_t)rank << 32 | i);
    }
    while (heap_size) {
        uint64_t top = heap_pop(heap, &heap_size);
        size_t pos = (size_t)(uint32_t)top;
        BpeSymbol *left = &symbols[pos];
        if (left->id == BPE_NO_ID || left->next < 0) continue;
        BpeSymbol *right = &symbols[left->next];
        // A stale entry: one of the two symbols has changed since it was pushed.
        if (!merge_map_get(merges, left->id, right->id, &rank, &merged) || rank != (uint32_t)(top >> 32)) continue;
        left->id = merged;
        right->id = BPE_NO_ID;
        left->next = right->next;
        if (left->next >= 0) symbols[left->next].prev = (int64_t)pos;
        uint32_t unused;
        if (left->prev >= 0 && merge_map_get(merges, symbols[left->prev].id, left->id, &rank, &unused))
            heap_push(heap, &heap_size, (uint64_t)rank << 32 | (uint64_t)left->prev);
        if (left->next >= 0 && merge_map_get(merges, left->id, symbols[left->next].id, &rank, &unused))
            heap_push(heap, &heap_size, (uint64_t)rank << 32 | pos);
    }
    size_t out = 0;
    for (int64_t i = 0; i >= 0; i = symbols[i].next) ids[out++] = symbols[i].id;
    *count = out;
    return 0;
}
