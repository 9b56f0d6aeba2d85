/*
 * The published-limits reader on its own: `fallback_cases cgroup FILE` and `fallback_cases
 * mountinfo FILE` print the pod UID the file names (or "-"); `fallback_cases limits FILE POD`
 * prints the bytes a process of POD ("" for none) applies, or "invalid".
 */
#include <stdio.h>
#include <string.h>

#include "../fallback.h"

int main(int argc, char **argv)
{
    if (argc < 3) return 2;
    FILE *f = fopen(argv[2], "r");
    if (f == NULL) return 2;
    int rc = 0;
    if (strcmp(argv[1], "limits") == 0 && argc == 4) {
        uint64_t bytes = 0;
        if (nvs_published_limit(f, argv[3], &bytes) == 0)
            printf("%llu\n", (unsigned long long)bytes);
        else
            printf("invalid\n");
    } else if (strcmp(argv[1], "cgroup") == 0 || strcmp(argv[1], "mountinfo") == 0) {
        char uid[37];
        printf("%s\n", nvs_pod_uid_in(f, strcmp(argv[1], "mountinfo") == 0, uid) ? uid : "-");
    } else {
        rc = 2;
    }
    fclose(f);
    return rc;
}
