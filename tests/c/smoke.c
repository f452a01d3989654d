/* The C ABI end to end on the host backend: plan, pool, views, a slot's window row written
 * through a view and read back through the pool, a decode stage + build whose window tail
 * matches the geometry, and errors with their variant names. Prints "N passed, M failed". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "v4pool.h"

static int passed = 0, failed = 0;

#define CHECK(cond)                                                                         \
    do {                                                                                    \
        if (cond) {                                                                         \
            passed++;                                                                       \
        } else {                                                                            \
            failed++;                                                                       \
            fprintf(stderr, "FAIL %s:%d: %s (last error %s: %s)\n", __FILE__, __LINE__, #cond, \
                    v4pool_last_error_variant(), v4pool_last_error_message());              \
        }                                                                                   \
    } while (0)

int main(void) {
    /* The library loaded is the one this header declares. */
    CHECK(v4pool_abi_version() == V4POOL_ABI_VERSION);
    V4poolPlan *plan = NULL;
    CHECK(v4pool_plan_new("v4-nope", 1ull << 30, 4, NULL, NULL, 0, &plan) == V4POOL_STATUS_REJECTED);
    CHECK(strcmp(v4pool_last_error_variant(), "UnknownPreset") == 0);
    /* A device as a config path: refused unread, never blocking or growing. */
    CHECK(v4pool_plan_new("/dev/zero", 1ull << 30, 4, NULL, NULL, 0, &plan) == V4POOL_STATUS_REJECTED);
    CHECK(strcmp(v4pool_last_error_variant(), "NotAFile") == 0);
    CHECK(v4pool_plan_new("v4-flash", 256ull << 20, 4, "fp8", "fp8", 0, &plan) == V4POOL_STATUS_OK);
    if (!plan) return 1;
    V4poolPlanInfo info = {.struct_size = sizeof(V4poolPlanInfo)};
    CHECK(v4pool_plan_info(plan, &info) == V4POOL_STATUS_OK);
    CHECK(info.num_slots == 4 && info.num_planes == 2 && info.plane_widths[0] == 512);
    char *json = NULL;
    CHECK(v4pool_plan_json(plan, &json) == V4POOL_STATUS_OK && strstr(json, "\"plane_rows\"") != NULL);
    v4pool_string_free(json);

    V4poolPool *pool = NULL;
    CHECK(v4pool_pool_new(plan, "host", 0, 0, &pool) == V4POOL_STATUS_OK);
    if (!pool) return 1;
    V4poolView view = {.struct_size = sizeof(V4poolView)}, plane0 = {.struct_size = sizeof(V4poolView)};
    CHECK(v4pool_pool_layer_view(pool, 2, 9, &view) == V4POOL_STATUS_REJECTED);
    CHECK(strcmp(v4pool_last_error_variant(), "NoSuchPlane") == 0);
    CHECK(v4pool_pool_plane(pool, 0, &plane0) == V4POOL_STATUS_OK && plane0.rows == info.plane_rows);

    /* A slot's window row of a CSA layer: write through the view, read through the pool. */
    V4poolSlot slot;
    CHECK(v4pool_pool_alloc_slot(pool, &slot) == V4POOL_STATUS_OK);
    const uint32_t layer = 2; /* V4-Flash: a compressed layer */
    CHECK(v4pool_pool_layer_view(pool, layer, 0, &view) == V4POOL_STATUS_OK && view.row_bytes == 512);
    int64_t row = -1;
    CHECK(v4pool_pool_window_index(pool, layer, slot.position, 5, &row) == V4POOL_STATUS_OK);
    uint8_t *bytes = (uint8_t *)(uintptr_t)(view.ptr + (uint64_t)row * view.row_bytes);
    for (int i = 0; i < 512; i++) bytes[i] = (uint8_t)(i * 7 + 3);
    uint8_t back[512];
    CHECK(v4pool_pool_read_plane(pool, 0, view.ptr + (uint64_t)row * 512 - plane0.ptr, back, 512) == V4POOL_STATUS_OK);
    CHECK(memcmp(back, bytes, 512) == 0);

    /* A decode step: one sequence at context 300 on two blocks. */
    V4poolBlock b0, b1;
    CHECK(v4pool_pool_alloc_block(pool, &b0) == V4POOL_STATUS_OK);
    CHECK(v4pool_pool_alloc_block(pool, &b1) == V4POOL_STATUS_OK);
    V4poolDecodeCapacity cap = {.struct_size = sizeof(V4poolDecodeCapacity), .max_seqs = 2, .max_tokens = 2, .max_blocks_per_seq = 2,
                                .win = 128, .index_topk = 512};
    V4poolDecode *dec = NULL;
    /* A struct of another header's size (or none set) is refused, typed, nothing made and the
     * caller's output struct left as it was: the library reads and writes only the sizes it
     * knows (issue 44 item 2). */
    V4poolDecodeCapacity shorter = cap;
    shorter.struct_size = (uint32_t)sizeof(V4poolDecodeCapacity) - 8;
    CHECK(v4pool_decode_new(pool, &shorter, &dec) == V4POOL_STATUS_ABI_MISMATCH && dec == NULL);
    CHECK(strcmp(v4pool_last_error_variant(), "StructSize") == 0);
    CHECK(strstr(v4pool_last_error_message(), "V4poolDecodeCapacity.struct_size") != NULL);
    shorter.struct_size = 0;
    CHECK(v4pool_decode_new(pool, &shorter, &dec) == V4POOL_STATUS_ABI_MISMATCH && dec == NULL);
    V4poolView bigger = {.struct_size = sizeof(V4poolView) + 8, .rows = -7};
    CHECK(v4pool_pool_plane(pool, 0, &bigger) == V4POOL_STATUS_ABI_MISMATCH && bigger.rows == -7);
    CHECK(strcmp(v4pool_last_error_variant(), "StructSize") == 0);
    V4poolPlanInfo unsized_info = {.num_slots = -7};
    CHECK(v4pool_plan_info(plan, &unsized_info) == V4POOL_STATUS_ABI_MISMATCH && unsized_info.num_slots == -7);
    CHECK(v4pool_decode_new(pool, &cap, &dec) == V4POOL_STATUS_OK);
    if (!dec) return 1;
    int64_t positions[1] = {slot.position}, ctx[1] = {300}, ntok[1] = {1};
    int32_t tables[2] = {(int32_t)b1.id, (int32_t)b0.id};
    size_t tokens = 0;
    CHECK(v4pool_decode_stage(dec, 1, positions, ctx, ntok, tables, 2, &tokens) == V4POOL_STATUS_OK && tokens == 1);
    CHECK(v4pool_decode_build(dec, 0) == V4POOL_STATUS_OK);
    CHECK(v4pool_decode_synchronize(dec) == V4POOL_STATUS_OK);
    V4poolBuffer indptr, idx;
    CHECK(v4pool_decode_buffer(dec, V4POOL_DECODE_BUFFER_INDPTR, 1, &indptr) == V4POOL_STATUS_OK);
    CHECK(v4pool_decode_buffer(dec, V4POOL_DECODE_BUFFER_INDICES, 1, &idx) == V4POOL_STATUS_OK);
    const int32_t *ip = (const int32_t *)(uintptr_t)indptr.ptr, *ix = (const int32_t *)(uintptr_t)idx.ptr;
    /* CSA slice of token 0 (pos 299): head min(300/4, 300/4, 512) = 75, window 128. */
    CHECK(ip[0] == 0 && ip[1] == 75 + 128);
    int64_t newest = -1;
    CHECK(v4pool_pool_window_index(pool, layer, slot.position, 299 % info.ring_slots, &newest) == V4POOL_STATUS_OK);
    CHECK(ix[ip[1] - 1] == newest);
    int64_t bad_pos[1] = {-3};
    CHECK(v4pool_decode_stage(dec, 1, bad_pos, ctx, ntok, tables, 2, NULL) == V4POOL_STATUS_REJECTED);
    CHECK(strcmp(v4pool_last_error_variant(), "BadPosition") == 0);
    CHECK(v4pool_decode_stage(dec, 1, NULL, ctx, ntok, tables, 2, NULL) == V4POOL_STATUS_INVALID_ARGUMENT);

    /* Free the pool first: the decode handle keeps it alive. */
    v4pool_pool_free(pool);
    CHECK(v4pool_decode_build(dec, 0) == V4POOL_STATUS_OK);
    v4pool_decode_free(dec);
    v4pool_plan_free(plan);

    /* FlashMLA's rows and operands: a flashmla-v4 pool, a FlashMLA-convention decode path. */
    CHECK(v4pool_plan_new("v4-flash", 512ull << 20, 2, "flashmla-v4", "fp8", 0, &plan) == V4POOL_STATUS_OK);
    if (!plan) return 1;
    CHECK(v4pool_pool_new(plan, "host", 0, 0, &pool) == V4POOL_STATUS_OK);
    if (!pool) return 1;
    CHECK(v4pool_pool_alloc_slot(pool, &slot) == V4POOL_STATUS_OK);
    CHECK(v4pool_pool_alloc_block(pool, &b0) == V4POOL_STATUS_OK);
    CHECK(v4pool_pool_alloc_block(pool, &b1) == V4POOL_STATUS_OK);
    const uint32_t hca = 3; /* V4-Flash: the first HCA layer */
    V4poolPageView pv = {.struct_size = sizeof(V4poolPageView)};
    CHECK(v4pool_pool_page_view(pool, hca, 0, 64, &pv) == V4POOL_STATUS_OK && pv.row_bytes == 584 && pv.page_rows == 64);
    CHECK(v4pool_pool_page_view(pool, hca, 0, 100, &pv) == V4POOL_STATUS_REJECTED);
    CHECK(v4pool_pool_page_view(pool, hca, 0, 64, &pv) == V4POOL_STATUS_OK);
    /* Unpacked, a layer's compressed view is its layer view; a dense layer has none. */
    V4poolView cv = {.struct_size = sizeof(V4poolView)};
    CHECK(v4pool_pool_compressed_view(pool, hca, &cv) == V4POOL_STATUS_OK && cv.row_bytes == 584);
    CHECK(v4pool_pool_compressed_view(pool, 0, &cv) == V4POOL_STATUS_REJECTED);
    V4poolFlashMlaWidths narrow = {.struct_size = sizeof(V4poolFlashMlaWidths), .topk = 100, .csa_extra_topk = 512, .hca_extra_topk = 64};
    CHECK(v4pool_decode_new_flashmla(pool, &cap, &narrow, &dec) == V4POOL_STATUS_REJECTED);
    CHECK(strcmp(v4pool_last_error_variant(), "FlashMlaWidth") == 0);
    narrow.struct_size = 4;
    CHECK(v4pool_decode_new_flashmla(pool, &cap, &narrow, &dec) == V4POOL_STATUS_ABI_MISMATCH);
    CHECK(strstr(v4pool_last_error_message(), "V4poolFlashMlaWidths") != NULL);
    /* 0 for the window and top-k: the pool's spec's (the model's, as V4poolPlanInfo reports
     * them), seen in the narrowest FlashMLA widths of a CSA layer (issue 44 item 1). */
    V4poolDecodeCapacity spec_cap = cap;
    spec_cap.win = 0;
    spec_cap.index_topk = 0;
    dec = NULL; /* the CSR path's handle above is freed */
    CHECK(v4pool_decode_new_flashmla(pool, &spec_cap, NULL, &dec) == V4POOL_STATUS_OK && dec != NULL);
    if (dec) {
        V4poolFlashMla csa_ops = {.struct_size = sizeof(V4poolFlashMla)};
        CHECK(v4pool_decode_flashmla(dec, layer, &csa_ops) == V4POOL_STATUS_OK);
        CHECK(csa_ops.topk == (info.sliding_window + 63) / 64 * 64);
        CHECK(csa_ops.extra_topk == (info.index_topk + 63) / 64 * 64 && csa_ops.extra_topk > 0);
        v4pool_decode_free(dec);
        dec = NULL;
    }
    CHECK(v4pool_decode_new_flashmla(pool, &cap, NULL, &dec) == V4POOL_STATUS_OK);
    if (!dec) return 1;
    positions[0] = slot.position;
    tables[0] = (int32_t)b1.id;
    tables[1] = (int32_t)b0.id;
    CHECK(v4pool_decode_stage(dec, 1, positions, ctx, ntok, tables, 2, &tokens) == V4POOL_STATUS_OK && tokens == 1);
    CHECK(v4pool_decode_build(dec, 0) == V4POOL_STATUS_OK);
    CHECK(v4pool_decode_synchronize(dec) == V4POOL_STATUS_OK);
    V4poolFlashMla ops = {.struct_size = sizeof(V4poolFlashMla)};
    CHECK(v4pool_decode_flashmla(dec, hca, &ops) == V4POOL_STATUS_OK && ops.shift == pv.row_shift);
    const int32_t *wi = (const int32_t *)(uintptr_t)ops.indices.ptr, *wl = (const int32_t *)(uintptr_t)ops.topk_length.ptr;
    const int32_t *ei = (const int32_t *)(uintptr_t)ops.extra_indices.ptr;
    const int32_t *el = (const int32_t *)(uintptr_t)ops.extra_topk_length.ptr;
    /* Token 0 at position 299: window 128 rows, newest last; HCA entries 300 / 128 = 2. */
    CHECK(wl[0] == 128 && ops.topk % 64 == 0 && ops.topk >= 128 && (ops.topk == 128 || wi[128] == -1));
    CHECK(v4pool_pool_window_index(pool, hca, slot.position, 299 % info.ring_slots, &newest) == V4POOL_STATUS_OK);
    CHECK(wi[127] == newest + ops.shift);
    CHECK(el[0] == 2 && ops.extra_topk % 64 == 0 && ei[2] == -1);
    /* FlashMLA's own per-sequence lengths ([max_seqs]): sequence 0 is the one token's, the pad
     * sequence 1 is 0 (docs/flashmla.md's MTP rule). */
    const int32_t *sl = (const int32_t *)(uintptr_t)ops.seq_topk_length.ptr;
    const int32_t *sel = (const int32_t *)(uintptr_t)ops.seq_extra_topk_length.ptr;
    CHECK(ops.seq_topk_length.len == cap.max_seqs && ops.seq_extra_topk_length.len == cap.max_seqs);
    CHECK(sl[0] == wl[0] && sl[1] == 0 && sel[0] == el[0] && sel[1] == 0);
    /* A dense layer has no compressed part: no per-sequence extra lengths either. */
    CHECK(v4pool_decode_flashmla(dec, 0, &ops) == V4POOL_STATUS_OK && ops.seq_topk_length.ptr != 0);
    CHECK(ops.extra_indices.ptr == 0 && ops.seq_extra_topk_length.ptr == 0);
    CHECK(v4pool_decode_flashmla(dec, 99, &ops) == V4POOL_STATUS_REJECTED);
    v4pool_decode_free(dec);
    v4pool_pool_free(pool);
    v4pool_plan_free(plan);

    /* KV events: v4pool's chained hashes for tokens, a publisher, one batch flushed. */
    uint32_t toks[600];
    for (int i = 0; i < 600; i++) toks[i] = (uint32_t)(i * 2654435761u);
    V4poolHash hs[4];
    size_t nh = 0;
    CHECK(v4pool_block_hashes("m@1", toks, 600, 256, NULL, hs, 4, &nh) == V4POOL_STATUS_OK && nh == 2);
    V4poolHash one[1];
    CHECK(v4pool_block_hashes("m@1", toks + 256, 256, 256, &hs[0], one, 1, &nh) == V4POOL_STATUS_OK && nh == 1);
    CHECK(one[0].lo == hs[1].lo && one[0].hi == hs[1].hi); /* chained from the parent */
    CHECK(v4pool_block_hashes("m@1", toks, 600, 256, NULL, hs, 1, &nh) == V4POOL_STATUS_INVALID_ARGUMENT && nh == 2);
    V4poolEvents *ev = NULL;
    V4poolStatus st = v4pool_events_new("tcp://127.0.0.1:*", NULL, "kv@c@v4", V4POOL_EVENT_ENCODING_ARRAY, 0, 256, &ev);
    if (st == V4POOL_STATUS_REJECTED && strcmp(v4pool_last_error_variant(), "ZmqUnavailable") == 0) {
        printf("SKIP: KV events in C: %s\n", v4pool_last_error_message());
    } else {
        CHECK(st == V4POOL_STATUS_OK && ev != NULL);
        CHECK(strncmp(v4pool_events_endpoint(ev), "tcp://127.0.0.1:", 16) == 0);
        CHECK(v4pool_events_replay_endpoint(ev) == NULL);
        int64_t seq = 7;
        CHECK(v4pool_events_flush(ev, &seq) == V4POOL_STATUS_OK && seq == -1); /* nothing yet */
        CHECK(v4pool_events_stored(ev, hs, 2, NULL, toks, 512, V4POOL_MEDIUM_GPU) == V4POOL_STATUS_OK);
        CHECK(v4pool_events_stored(ev, hs, 2, NULL, toks, 100, V4POOL_MEDIUM_GPU) == V4POOL_STATUS_INVALID_ARGUMENT);
        CHECK(v4pool_events_removed(ev, hs, 1, 9) == V4POOL_STATUS_INVALID_ARGUMENT);
        CHECK(v4pool_events_removed(ev, hs, 1, V4POOL_MEDIUM_CPU) == V4POOL_STATUS_OK);
        CHECK(v4pool_events_cleared(ev) == V4POOL_STATUS_OK);
        CHECK(v4pool_events_flush(ev, &seq) == V4POOL_STATUS_OK && seq == 0);
        CHECK(v4pool_events_cleared(ev) == V4POOL_STATUS_OK);
        CHECK(v4pool_events_flush(ev, &seq) == V4POOL_STATUS_OK && seq == 1);
        v4pool_events_free(ev);
    }
    CHECK(v4pool_events_new("tcp://127.0.0.1:*", NULL, NULL, 5, 0, 256, &ev) == V4POOL_STATUS_INVALID_ARGUMENT);

    printf("smoke: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
