// A small JSON reader, enough for Hugging Face tokenizer.json files (Llama 3's is ~9 MB).
// json_parse builds a read-only tree in one arena: objects keep their members in file order,
// strings are decoded (\uXXXX escapes, surrogate pairs joined into UTF-8) and NUL-terminated,
// with their byte length kept because "\u0000" may occur inside them. Numbers are doubles.
#pragma once
#include <stddef.h>

typedef enum { JSON_NULL, JSON_FALSE, JSON_TRUE, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } JsonType;

typedef struct JsonValue JsonValue;
typedef struct JsonMember JsonMember;

struct JsonValue {
    JsonType type;
    size_t count;              // bytes of a string, items of an array, members of an object
    double number;             // JSON_NUMBER
    const char *string;        // JSON_STRING
    const JsonValue *items;    // JSON_ARRAY
    const JsonMember *members; // JSON_OBJECT
};

struct JsonMember {
    const char *key;
    size_t key_len;
    JsonValue value;
};

typedef struct JsonDocument JsonDocument;

// Parses text[0..len). Returns NULL on error with "line L column C: what is wrong" in error.
JsonDocument *json_parse(const char *text, size_t len, char *error, size_t error_size);
void json_free(JsonDocument *doc);
const JsonValue *json_root(const JsonDocument *doc);

// The member named key of an object, or NULL (also when value is not an object).
const JsonValue *json_get(const JsonValue *object, const char *key);
// 1 when value is a string equal to text.
int json_is_string(const JsonValue *value, const char *text);
