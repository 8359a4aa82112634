/* CRC-32C (Castagnoli), as Google Cloud Storage reports it per object, and the combination of two
 * pieces' CRCs, so pieces read in any order check one whole object. The SSE 4.2 instruction is
 * used where the CPU has it, on three lanes at once for long inputs (its latency is three times
 * its issue rate), the lanes combined after; elsewhere a nibble table (~0.5 GB/s). */
#include "streamer_engine.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82F63B78u /* reflected */
#define LANES_MIN_BYTES 65536 /* below this, one lane: combining costs ~1 us */

static uint32_t crc32c_portable(uint32_t crc, const uint8_t *data, size_t length) {
    static const uint32_t nibble[16] = {
        0x00000000, 0x105EC76F, 0x20BD8EDE, 0x30E349B1, 0x417B1DBC, 0x5125DAD3, 0x61C69362, 0x7198540D,
        0x82F63B78, 0x92A8FC17, 0xA24BB5A6, 0xB21572C9, 0xC38D26C4, 0xD3D3E1AB, 0xE330A81A, 0xF36E6F75,
    };
    for (size_t i = 0; i < length; i++) {
        crc ^= data[i];
        crc = (crc >> 4) ^ nibble[crc & 15];
        crc = (crc >> 4) ^ nibble[crc & 15];
    }
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const uint8_t *data,
                                                              size_t length) {
    uint64_t wide = crc;
    for (; length >= 8; data += 8, length -= 8) {
        uint64_t word;
        memcpy(&word, data, sizeof word);
        wide = __builtin_ia32_crc32di(wide, word);
    }
    uint32_t narrow = (uint32_t)wide;
    for (; length > 0; data++, length--) {
        narrow = __builtin_ia32_crc32qi(narrow, *data);
    }
    return narrow;
}

static int has_sse42(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}

/* Three thirds of the input on three independent chains; the last lane also takes the tail. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_lanes(uint32_t crc, const uint8_t *data,
                                                              size_t length) {
    size_t lane = length / 3 / 8 * 8;
    const uint8_t *b = data + lane, *c = data + 2 * lane;
    uint64_t ra = ~crc, rb = 0xFFFFFFFFu, rc = 0xFFFFFFFFu;
    for (size_t i = 0; i < lane; i += 8) {
        uint64_t wa, wb, wc;
        memcpy(&wa, data + i, sizeof wa);
        memcpy(&wb, b + i, sizeof wb);
        memcpy(&wc, c + i, sizeof wc);
        ra = __builtin_ia32_crc32di(ra, wa);
        rb = __builtin_ia32_crc32di(rb, wb);
        rc = __builtin_ia32_crc32di(rc, wc);
    }
    uint32_t crc_a = ~(uint32_t)ra, crc_b = ~(uint32_t)rb;
    uint32_t crc_c = ~crc32c_sse42((uint32_t)rc, c + lane, length - 3 * lane);
    return se_crc32c_combine(se_crc32c_combine(crc_a, crc_b, lane), crc_c, length - 2 * lane);
}
#endif

/* a(x) * b(x) modulo the polynomial, both reflected (x^0 is the top bit). */
static uint32_t multiply_mod(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {
        if (a & bit) {
            product ^= b;
        }
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return product;
}

uint32_t se_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
    /* crc(A || B) = crc_a * x^(8 * length_b) + crc_b, modulo the polynomial. */
    uint32_t shift = 1u << 31;      /* x^0 */
    uint32_t power = 1u << (31 - 8); /* x^8: one byte; squared at each bit of length_b */
    for (uint64_t n = length_b; n != 0; n >>= 1) {
        if (n & 1) {
            shift = multiply_mod(power, shift);
        }
        power = multiply_mod(power, power);
    }
    return multiply_mod(shift, crc_a) ^ crc_b;
}

uint32_t se_crc32c(uint32_t crc, const void *data, size_t length) {
    const uint8_t *bytes = data;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (has_sse42()) {
        return length >= LANES_MIN_BYTES ? crc32c_lanes(crc, bytes, length) : ~crc32c_sse42(~crc, bytes, length);
    }
#endif
    return ~crc32c_portable(~crc, bytes, length);
}
