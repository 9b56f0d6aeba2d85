/*
 * Runs the hook's size parser (size.c) on one size per line of stdin and prints one answer per
 * line: "ok BYTES", "syntax" or "too-large". tests/policy/test_sizes.py feeds it the table of
 * cases in tests/data/sizes.json and compares with the Python parser.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "../config.h"

int main(void)
{
    char line[4096];
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        uint64_t bytes = 0;
        int rc = nvs_parse_bytes(line, &bytes);
        if (rc == NVS_SIZE_OK)
            printf("ok %" PRIu64 "\n", bytes);
        else
            printf("%s\n", rc == NVS_SIZE_TOO_LARGE ? "too-large" : "syntax");
    }
    return 0;
}
