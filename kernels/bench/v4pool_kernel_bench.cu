// Standalone timing of the index builders on an NVIDIA GPU (nvcc; no Rust needed):
//   nvcc -arch=sm_90 -O3 -std=c++17 -o bench kernels/bench/v4pool_kernel_bench.cu && ./bench
// Decode step at batch 256 with 1M contexts (HCA heads of 8192 entries per token), prefill of
// 8192 tokens ending at 1M, CSA translate-pack of 21 layers; each against a cudaMemset of the
// bytes it writes (the bandwidth floor). Spot-checks a few outputs against the formulas.
#include "../v4pool_kernels.cu"

#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                        \
    do {                                                                             \
        cudaError_t e_ = (x);                                                        \
        if (e_ != cudaSuccess) {                                                     \
            std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            std::exit(1);                                                            \
        }                                                                            \
    } while (0)

template <typename T>
static T* upload(const std::vector<T>& v) {
    T* d;
    CK(cudaMalloc(&d, v.size() * sizeof(T) + 16));
    CK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
static int* alloc_i32(size_t n) {
    int* d;
    CK(cudaMalloc(&d, n * 4 + 16));
    CK(cudaMemset(d, 0xf9, n * 4));
    return d;
}

template <typename F>
static float time_us(F f, int iters = 200) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 10; ++i) f();
    CK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGetLastError());
    return ms * 1000.f / iters;
}

int main() {
    const int B = 256, WIN = 128, RING = 133, TOPK = 512;
    const long long CTX = 1 << 20, ENVELOPE = 2688;  // V4-Flash-like envelope rows
    const int RPB = 2, HCA_HEAD = (int)(CTX / 128), STRIDE = HCA_HEAD / RPB;
    WindowParams dense{0, 12000, RING, RING, 2 * RING};
    WindowParams csa{4000, 12000, RING, 64, 21 * 64};
    WindowParams hca{300, 12000, RING, 2, 20 * 2};

    // ---- decode step ----
    std::vector<int> slots(B), bids(B);
    std::vector<long long> pos(B);
    std::vector<int> tables((size_t)B * STRIDE);
    for (int b = 0; b < B; ++b) {
        slots[b] = 100 + b;
        bids[b] = b;
        pos[b] = CTX - 1 - b;
    }
    for (size_t i = 0; i < tables.size(); ++i) tables[i] = (int)((i * 2654435761u) % 50000);
    std::vector<int> swa_ptr(B + 1), csa_ptr(B + 1), hca_ptr(B + 1);
    for (int t = 0; t <= B; ++t) {
        swa_ptr[t] = t * WIN;
        csa_ptr[t] = t * (WIN + TOPK);
        hca_ptr[t] = t * (WIN + HCA_HEAD);
    }
    int* d_swa = alloc_i32((size_t)B * WIN);
    int* d_csa = alloc_i32((size_t)B * (WIN + TOPK));
    int* d_hca = alloc_i32((size_t)B * (WIN + HCA_HEAD));
    int* d_dest = alloc_i32(3 * B);
    DecodeIndexArgs d{};
    d.classes[0] = ClassBuffers{dense, (v4p_ptr)upload(swa_ptr), (v4p_ptr)d_swa, (v4p_ptr)d_dest};
    d.classes[1] = ClassBuffers{csa, (v4p_ptr)upload(csa_ptr), (v4p_ptr)d_csa, (v4p_ptr)(d_dest + B)};
    d.classes[2] = ClassBuffers{hca, (v4p_ptr)upload(hca_ptr), (v4p_ptr)d_hca, (v4p_ptr)(d_dest + 2 * B)};
    d.state_slot_per_seq = (v4p_ptr)upload(slots);
    d.batch_id_per_token = (v4p_ptr)upload(bids);
    d.positions = (v4p_ptr)upload(pos);
    d.block_tables = (v4p_ptr)upload(tables);
    d.envelope_rows = ENVELOPE;
    d.block_table_stride = STRIDE;
    d.hca_rows_per_block = RPB;
    d.num_tokens = B;
    d.win = WIN;
    // The grid of src/index/shape.rs: (token, tile of the fused HCA head).
    dim3 dgrid(B, ((long long)STRIDE * RPB + V4POOL_DECODE_HCA_TILE - 1) / V4POOL_DECODE_HCA_TILE);
    float dec = time_us([&] { v4pool_decode_indices<<<dgrid, V4POOL_BLOCK_THREADS>>>(d); });
    size_t dec_bytes = (size_t)B * (3 * WIN + HCA_HEAD) * 4;
    // Spot check: token 7's HCA entry 4097 and its newest window row.
    std::vector<int> h((size_t)B * (WIN + HCA_HEAD));
    CK(cudaMemcpy(h.data(), d_hca, h.size() * 4, cudaMemcpyDeviceToHost));
    long long e = 4097, want = (long long)tables[7 * STRIDE + e / RPB] * ENVELOPE + e % RPB;
    long long q = pos[7] % RING, want_w = slots[7] * hca.slot_rows + hca.ring_start + (q / 2) * hca.run_rows + q % 2;
    int ok = h[(size_t)hca_ptr[7] + e] == want && h[(size_t)hca_ptr[8] - 1] == want_w;
    if (!ok)
        std::printf("decode check: entry %d want %lld, newest %d want %lld\n", h[(size_t)hca_ptr[7] + e], want,
                    h[(size_t)hca_ptr[8] - 1], want_w);
    // The floor zeroes the buffer: time it after the check.
    float dec_floor = time_us([&] { CK(cudaMemsetAsync(d_hca, 0, (size_t)B * (WIN + HCA_HEAD) * 4)); });
    std::printf("decode B=%d heads=%d: %.2f us (%.1f MB written, %.2f TB/s; memset of the HCA buffer %.2f us) check %s\n",
                B, HCA_HEAD, dec, dec_bytes / 1e6, dec_bytes / dec / 1e6, dec_floor, ok ? "ok" : "FAILED");

    // ---- CSA translate-pack, 21 layers ----
    const int L = 21;
    std::vector<int> topk((size_t)L * B * TOPK);
    for (size_t i = 0; i < topk.size(); ++i) topk[i] = (int)((i * 40503u) % (CTX / 4));
    std::vector<int> csa_tables((size_t)B * (CTX / 256));
    for (size_t i = 0; i < csa_tables.size(); ++i) csa_tables[i] = (int)(i % 50000);
    int* d_csa_l = alloc_i32((size_t)L * B * (WIN + TOPK));
    CsaPackArgs c{};
    c.topk = (v4p_ptr)upload(topk);
    c.block_tables = (v4p_ptr)upload(csa_tables);
    c.positions = d.positions;
    c.indptr = d.classes[1].indptr;
    c.batch_id_per_token = d.batch_id_per_token;
    c.out = (v4p_ptr)d_csa_l;
    c.topk_layer_stride = (long long)B * TOPK;
    c.out_layer_stride = (long long)B * (WIN + TOPK);
    c.envelope_rows = ENVELOPE;
    c.topk_row_stride = TOPK;
    c.block_table_stride = (int)(CTX / 256);
    c.num_tokens = B;
    c.num_layers = L;
    c.block_capacity = 64;
    c.window_size = WIN;
    dim3 cgrid(B, (TOPK + V4POOL_CSA_TILE - 1) / V4POOL_CSA_TILE,
               (L + V4POOL_CSA_LAYERS_PER_BLOCK - 1) / V4POOL_CSA_LAYERS_PER_BLOCK);
    float cp = time_us([&] { v4pool_csa_translate_pack<<<cgrid, V4POOL_BLOCK_THREADS>>>(c); });
    size_t cp_bytes = (size_t)L * B * TOPK * 8;  // read top-k + write rows
    std::printf("csa pack L=%d B=%d topk=%d: %.2f us (%.1f MB moved, %.2f TB/s)\n", L, B, TOPK, cp, cp_bytes / 1e6,
                cp_bytes / cp / 1e6);

    // ---- prefill, 8192 tokens ending at 1M ----
    const int T = 8192;
    const long long CS = CTX - T;
    std::vector<int> ppos(T), pbid(T, 0), cs1{(int)CS}, cu1{0}, slot1{7}, ncomm{(int)(CTX / 128)};
    for (int t = 0; t < T; ++t) ppos[t] = (int)(CS + t);
    std::vector<int> ext_ptr(T + 1), swa_p(T + 1), csa_p(T + 1), hca_p(T + 1);
    long long ext_n = 0, swa_n = 0, csa_n = 0, hca_n = 0;
    for (int t = 0; t <= T; ++t) {
        ext_ptr[t] = (int)ext_n;
        swa_p[t] = (int)swa_n;
        csa_p[t] = (int)csa_n;
        hca_p[t] = (int)hca_n;
        if (t == T) break;
        long long p = ppos[t], low = p - WIN + 1 > 0 ? p - WIN + 1 : 0;
        long long in_chunk = p - CS, ext = in_chunk + 1 < WIN ? in_chunk + 1 : WIN, pre = CS - low > 0 ? CS - low : 0;
        long long nh = (p + 1) / 128 < ncomm[0] ? (p + 1) / 128 : ncomm[0];
        ext_n += ext;
        swa_n += pre;
        csa_n += pre + TOPK;
        hca_n += pre + nh;
    }
    std::vector<int> ptable(CTX / 256);
    for (size_t i = 0; i < ptable.size(); ++i) ptable[i] = (int)((i * 7919) % 50000);
    PrefillIndexArgs pa{};
    pa.dense = dense;
    pa.csa = csa;
    pa.hca = hca;
    pa.positions = (v4p_ptr)upload(ppos);
    pa.bid_per_token = (v4p_ptr)upload(pbid);
    pa.chunk_start_per_seq = (v4p_ptr)upload(cs1);
    pa.cu_seqlens_q_per_seq = (v4p_ptr)upload(cu1);
    pa.state_slot_per_seq = (v4p_ptr)upload(slot1);
    pa.n_committed_hca_per_seq = (v4p_ptr)upload(ncomm);
    pa.block_tables = (v4p_ptr)upload(ptable);
    pa.extend_indptr = (v4p_ptr)upload(ext_ptr);
    pa.extend_indices = (v4p_ptr)alloc_i32(ext_n);
    pa.swa_indptr = (v4p_ptr)upload(swa_p);
    pa.swa_indices = (v4p_ptr)alloc_i32(swa_n);
    pa.csa_indptr = (v4p_ptr)upload(csa_p);
    pa.csa_indices = (v4p_ptr)alloc_i32(csa_n);
    pa.hca_indptr = (v4p_ptr)upload(hca_p);
    int* d_phca = alloc_i32(hca_n);
    pa.hca_indices = (v4p_ptr)d_phca;
    pa.envelope_rows = ENVELOPE;
    pa.block_table_stride = (int)(CTX / 256);
    pa.num_tokens = T;
    pa.win = WIN;
    pa.hca_ratio = 128;
    pa.hca_rows_per_block = RPB;
    float pf = time_us([&] { v4pool_prefill_indices<<<T, V4POOL_BLOCK_THREADS>>>(pa); }, 50);
    size_t pf_bytes = (size_t)(ext_n + 2 * swa_n + hca_n) * 4;  // csa: window tails only
    std::vector<int> ph(hca_n);
    CK(cudaMemcpy(ph.data(), d_phca, hca_n * 4, cudaMemcpyDeviceToHost));
    long long t_last = T - 1, j = 5000;
    long long pre_last = 0;  // the last token's window is all in-chunk
    long long pwant = (long long)ptable[j / RPB] * ENVELOPE + j % RPB;
    int pok = ph[(size_t)hca_p[t_last] + pre_last + j] == pwant;
    if (!pok) std::printf("prefill check: got %d want %lld\n", ph[(size_t)hca_p[t_last] + pre_last + j], pwant);
    float pf_floor = time_us([&] { CK(cudaMemsetAsync(d_phca, 0, (size_t)hca_n * 4)); }, 50);
    std::printf("prefill T=%d at 1M: %.2f us (%.1f MB written, %.2f TB/s; memset of the HCA buffer %.2f us) check %s\n",
                T, pf, pf_bytes / 1e6, pf_bytes / pf / 1e6, pf_floor, pok ? "ok" : "FAILED");
    return ok && pok ? 0 : 1;
}
