/* The fake GPU's UUID bytes, shared by the fake driver and the fake NVML so both name the same
 * device: NVSHARE_FAKE_GPU_UUID ("GPU-xxxxxxxx-...") when set, else 0x10..0x1f. Device n adds n
 * to the last byte. */
#ifndef NVSHARE_FAKE_UUID_H
#define NVSHARE_FAKE_UUID_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline void fake_uuid_bytes(unsigned char out[16])
{
    for (int i = 0; i < 16; i++) out[i] = (unsigned char)(0x10 + i);
    const char *u = getenv("NVSHARE_FAKE_GPU_UUID");
    if (u == NULL || strncmp(u, "GPU-", 4) != 0) return;
    int k = 0;
    for (const char *p = u + 4; *p && k < 16; p++) {
        unsigned v;
        if (*p == '-') continue;
        if (sscanf(p, "%2x", &v) != 1) break;
        out[k++] = (unsigned char)v;
        p++;
    }
}

#endif
