/*
 * NVSHARE_GPU_MEMORY_LIMIT's grammar: the one the whole project uses for sizes, so that a value
 * means the same in a policy file, a pod annotation, nvsharectl and the environment.
 * appliance/policy/quantity.py is the other implementation; tests/data/sizes.json is the table
 * of cases both are tested against (tests/policy/test_sizes.py).
 *
 *   size   := digits [ "." 1-9 digits ] [ unit ]      surrounding blanks are ignored
 *   unit   := Ki Mi Gi Ti Pi Ei (powers of 1024) | k M G T P E (powers of 1000)
 *   no unit: MiB.   A fraction of a byte rounds up.   At most 1Ei (2^60 bytes).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "config.h"

#define MAX_FRACTION_DIGITS 9
#define MAX_SIZE (1ull << 60)

static int is_digit(char c) { return c >= '0' && c <= '9'; }
static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static int unit_multiplier(const char *unit, size_t len, unsigned long long *mult)
{
    static const struct {
        const char *name;
        unsigned long long mult;
    } units[] = {
        {"", 1ull << 20},       {"Ki", 1ull << 10},     {"Mi", 1ull << 20},   {"Gi", 1ull << 30},
        {"Ti", 1ull << 40},     {"Pi", 1ull << 50},     {"Ei", 1ull << 60},   {"k", 1000ull},
        {"M", 1000000ull},      {"G", 1000000000ull},   {"T", 1000000000000ull},
        {"P", 1000000000000000ull}, {"E", 1000000000000000000ull},
    };
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strlen(units[i].name) == len && strncmp(unit, units[i].name, len) == 0) {
            *mult = units[i].mult;
            return 0;
        }
    }
    return -1;
}

int nvs_parse_bytes(const char *text, uint64_t *out)
{
    if (text == NULL) return NVS_SIZE_SYNTAX;
    const char *p = text;
    while (is_blank(*p)) p++;
    if (!is_digit(*p)) return NVS_SIZE_SYNTAX;
    /* The whole part saturates just above the maximum: only "too large" matters past it. */
    unsigned __int128 whole = 0;
    for (; is_digit(*p); p++) {
        if (whole <= MAX_SIZE) whole = whole * 10 + (unsigned)(*p - '0');
    }
    unsigned __int128 frac = 0, scale = 1;
    if (*p == '.') {
        p++;
        int digits = 0;
        for (; is_digit(*p); p++, digits++) {
            if (digits == MAX_FRACTION_DIGITS) return NVS_SIZE_SYNTAX;
            frac = frac * 10 + (unsigned)(*p - '0');
            scale *= 10;
        }
        if (digits == 0) return NVS_SIZE_SYNTAX;
    }
    const char *unit = p;
    while (*p != '\0' && !is_blank(*p)) p++;
    size_t unit_len = (size_t)(p - unit);
    while (is_blank(*p)) p++;
    unsigned long long mult;
    if (*p != '\0' || unit_multiplier(unit, unit_len, &mult) != 0) return NVS_SIZE_SYNTAX;
    if (whole > MAX_SIZE) return NVS_SIZE_TOO_LARGE;
    /* whole * mult < 2^61 * 2^60 and frac * mult < 10^9 * 2^60: both fit in 128 bits */
    unsigned __int128 bytes = whole * mult + (frac * mult + scale - 1) / scale;
    if (bytes > MAX_SIZE) return NVS_SIZE_TOO_LARGE;
    *out = (uint64_t)bytes;
    return NVS_SIZE_OK;
}
