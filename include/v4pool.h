#ifndef V4POOL_H
#define V4POOL_H

/* Generated from src/bindings/capi/mod.rs by cbindgen (include/cbindgen.toml): do not edit. */

#include <stdint.h>
#include <stddef.h>

/* The C ABI version this header declares; compare with v4pool_abi_version() at start-up.
 * Every struct passed by pointer starts with struct_size: set it to sizeof(the struct)
 * (e.g. V4poolView v = {.struct_size = sizeof(V4poolView)};) before the call, for input and
 * output structs alike; the library refuses a size it does not know (V4POOL_STATUS_ABI_MISMATCH). */
#define V4POOL_ABI_VERSION 1

/**
 * What a call returned.
 */
typedef enum V4poolStatus {
  /**
   * Success.
   */
  V4POOL_STATUS_OK = 0,
  /**
   * A null pointer, a non-UTF-8 string, an unknown name.
   */
  V4POOL_STATUS_INVALID_ARGUMENT = 1,
  /**
   * The library rejected the input (see the last error's variant).
   */
  V4POOL_STATUS_REJECTED = 2,
  /**
   * The backend failed (driver absent, out of memory, a failed launch).
   */
  V4POOL_STATUS_BACKEND = 3,
  /**
   * A bug: a Rust panic was caught at the boundary.
   */
  V4POOL_STATUS_PANIC = 4,
  /**
   * A struct's `struct_size` is not a size this library knows (variant `StructSize`; the
   * message names the struct, the size given and the sizes known): the caller was compiled
   * against another `v4pool.h`, or left `struct_size` unset.
   */
  V4POOL_STATUS_ABI_MISMATCH = 5,
} V4poolStatus;

/**
 * Which decode buffer `v4pool_decode_buffer` returns (passed as its integer value).
 */
typedef enum V4poolDecodeBuffer {
  /**
   * The class's index buffer.
   */
  V4POOL_DECODE_BUFFER_INDICES = 0,
  /**
   * Its per-token offsets.
   */
  V4POOL_DECODE_BUFFER_INDPTR = 1,
  /**
   * Destination rows of the step's tokens.
   */
  V4POOL_DECODE_BUFFER_DEST_ROWS = 2,
} V4poolDecodeBuffer;

/**
 * Where blocks are resident (an event's `medium`).
 */
typedef enum V4poolMedium {
  /**
   * The pool (HBM).
   */
  V4POOL_MEDIUM_GPU = 0,
  /**
   * The host tier.
   */
  V4POOL_MEDIUM_CPU = 1,
  /**
   * The shared tier.
   */
  V4POOL_MEDIUM_STORAGE = 2,
} V4poolMedium;

/**
 * How events are encoded: tagged arrays (llm-d, Dynamo) or tagged maps (vLLM 0.33.0's
 * classes, Dynamo).
 */
typedef enum V4poolEventEncoding {
  /**
   * `[tag, fields…]`.
   */
  V4POOL_EVENT_ENCODING_ARRAY = 0,
  /**
   * `{"type": tag, …}`.
   */
  V4POOL_EVENT_ENCODING_MAP = 1,
} V4poolEventEncoding;

/**
 * A KV class's slot in the index buffers: dense, fine ("CSA"), coarse ("HCA").
 *
 * The discriminant is the slot in the decode builder's `classes` array (the kernels'
 * `V4POOL_CLASS_*`), so `class as usize` indexes it. Which compress ratio fills a slot is
 * the geometry's data ([`UnifiedPoolGeometry::class_ratio`]): V4's 4 and 128
 * ([`Class::ratio`]), V4.1's 1 and 2.
 */
typedef struct V4poolClass V4poolClass;

/**
 * One compressor of a layer: the arena field pair it writes and its pool window.
 */
typedef struct V4poolCompressor V4poolCompressor;

/**
 * A checked top-k buffer for a pool's CSA packs (opaque).
 */
typedef struct V4poolCsaTopk V4poolCsaTopk;

/**
 * Decode index buffers of one pool (opaque).
 */
typedef struct V4poolDecode V4poolDecode;

/**
 * A KV event publisher with the events added since its last flush (opaque).
 */
typedef struct V4poolEvents V4poolEvents;

/**
 * A sized plan (opaque).
 */
typedef struct V4poolPlan V4poolPlan;

/**
 * A pool on a backend (opaque).
 */
typedef struct V4poolPool V4poolPool;

/**
 * A plan's main numbers.
 */
typedef struct V4poolPlanInfo {
  /**
   * `sizeof` of this struct, set by the caller (see the header's versioning note).
   */
  uint32_t struct_size;
  /**
   * Blocks at the plan's split.
   */
  int64_t num_blocks;
  /**
   * Slots at the plan's split.
   */
  int64_t num_slots;
  /**
   * Rows of each plane (fixed for the pool's life).
   */
  int64_t plane_rows;
  /**
   * Planes: 2 (fp8 NoPE + bf16 RoPE) or 1 (bf16).
   */
  uint32_t num_planes;
  /**
   * Row bytes of each plane (the second is 0 for the one-plane bf16 layout).
   */
  uint64_t plane_widths[2];
  /**
   * Tokens per block.
   */
  int64_t block_size;
  /**
   * Sliding window length.
   */
  int64_t sliding_window;
  /**
   * Ring entries per slot and window layer (window + speculative steps).
   */
  int64_t ring_slots;
  /**
   * CSA top-k per token.
   */
  int64_t index_topk;
  /**
   * Speculative (MTP) steps.
   */
  int64_t spec_steps;
  /**
   * Bytes the pool allocates.
   */
  uint64_t total_bytes;
} V4poolPlanInfo;

/**
 * One layer's view of one plane (or a whole plane, `layer` = -1): row `x` is at
 * `ptr + x * row_bytes`.
 */
typedef struct V4poolView {
  /**
   * `sizeof` of this struct, set by the caller (see the header's versioning note).
   */
  uint32_t struct_size;
  /**
   * Device (or host) address of row 0.
   */
  uint64_t ptr;
  /**
   * Rows addressable from `ptr`.
   */
  int64_t rows;
  /**
   * Bytes per row.
   */
  uint64_t row_bytes;
} V4poolView;

/**
 * A layer's rows as a paged attention kernel takes them (FlashMLA's `k_cache`
 * `[pages, page_rows, 1, row_bytes]`): the page holding the layer's first row of plane
 * `plane`, whole pages to the plane's end, and the shift its view indices take
 * (`Pool::page_view`; `NotPageable` where the layer's pages are not whole in the plane).
 */
typedef struct V4poolPageView {
  /**
   * `sizeof` of this struct, set by the caller (see the header's versioning note).
   */
  uint32_t struct_size;
  /**
   * Address of the first page.
   */
  uint64_t ptr;
  /**
   * Whole pages from there to the plane's end.
   */
  int64_t pages;
  /**
   * Rows of a page.
   */
  int64_t page_rows;
  /**
   * Bytes per row.
   */
  uint64_t row_bytes;
  /**
   * Kernel index of view row 0: add it to the layer's view indices.
   */
  int64_t row_shift;
} V4poolPageView;

/**
 * A slot handed out: the allocator's handle and its position.
 */
typedef struct V4poolSlot {
  /**
   * The allocator's group id.
   */
  uint32_t group;
  /**
   * The allocator that handed it out.
   */
  uint32_t pool;
  /**
   * Generation, checked on every use.
   */
  uint64_t generation;
  /**
   * Physical slot position (what kernels take).
   */
  int64_t position;
} V4poolSlot;

/**
 * A block handed out.
 */
typedef struct V4poolBlock {
  /**
   * Block id (row-space envelope index).
   */
  uint32_t id;
  /**
   * The allocator that handed it out.
   */
  uint32_t pool;
  /**
   * Generation, checked on every use.
   */
  uint64_t generation;
} V4poolBlock;

/**
 * Capacities of decode index buffers (see `DecodeCapacity`).
 */
typedef struct V4poolDecodeCapacity {
  /**
   * `sizeof` of this struct, set by the caller (see the header's versioning note).
   */
  uint32_t struct_size;
  /**
   * Sequences in one step.
   */
  uint64_t max_seqs;
  /**
   * Tokens in one step.
   */
  uint64_t max_tokens;
  /**
   * Block-table columns per sequence.
   */
  uint64_t max_blocks_per_seq;
  /**
   * Sliding window; 0: the pool's (its plan's model's, `V4poolPlanInfo::sliding_window`).
   */
  int32_t win;
  /**
   * CSA top-k reserved per token; 0: the pool's (its plan's model's,
   * `V4poolPlanInfo::index_topk`).
   */
  int32_t index_topk;
} V4poolDecodeCapacity;

/**
 * Index widths of a FlashMLA-convention decode path (see `FlashMlaWidths`): entries per row
 * of the window part (`topk`), the CSA and the HCA compressed parts; multiples of 64.
 */
typedef struct V4poolFlashMlaWidths {
  /**
   * `sizeof` of this struct, set by the caller (see the header's versioning note).
   */
  uint32_t struct_size;
  /**
   * Window part (`indices`), at least the window.
   */
  int32_t topk;
  /**
   * CSA compressed part, at least the top-k.
   */
  int32_t csa_extra_topk;
  /**
   * HCA compressed part, at least the longest HCA head the capacity allows.
   */
  int32_t hca_extra_topk;
} V4poolFlashMlaWidths;

/**
 * A device buffer of `len` int32 elements.
 */
typedef struct V4poolBuffer {
  /**
   * Device address.
   */
  uint64_t ptr;
  /**
   * Elements (int32).
   */
  uint64_t len;
} V4poolBuffer;

/**
 * One layer's FlashMLA operands in a FlashMLA-convention decode path: int32 buffers
 * `indices [max_tokens × topk]`, `topk_length [max_tokens]` (per token), and for a compressed
 * layer `extra_indices [max_tokens × extra_topk]`, `extra_topk_length` (`ptr` 0 for a dense
 * layer); every index already shifted by `shift` to the layer's page view
 * (`v4pool_pool_page_view`'s first page). FlashMLA's own lengths are per batch entry:
 * `seq_topk_length` / `seq_extra_topk_length [max_seqs]` (MTP: stage every sequence with the
 * same `s_q` tokens, then `indices` is `[B, s_q, topk]` with these; docs/flashmla.md).
 */
typedef struct V4poolFlashMla {
  /**
   * `sizeof` of this struct, set by the caller (see the header's versioning note).
   */
  uint32_t struct_size;
  /**
   * `indices` (FlashMLA's window part).
   */
  struct V4poolBuffer indices;
  /**
   * `topk_length`.
   */
  struct V4poolBuffer topk_length;
  /**
   * `extra_indices_in_kvcache` (0 for a dense layer).
   */
  struct V4poolBuffer extra_indices;
  /**
   * `extra_topk_length` (0 for a dense layer).
   */
  struct V4poolBuffer extra_topk_length;
  /**
   * FlashMLA's own `topk_length [max_seqs]`, per batch entry (a staged sequence): the
   * longest of its tokens' `topk_length`, 0 for a pad (docs/flashmla.md, the MTP rule).
   */
  struct V4poolBuffer seq_topk_length;
  /**
   * FlashMLA's own `extra_topk_length [max_seqs]`, formed likewise (0 for a dense layer).
   */
  struct V4poolBuffer seq_extra_topk_length;
  /**
   * Entries per row of `indices`.
   */
  int32_t topk;
  /**
   * Entries per row of `extra_indices` (0 for a dense layer).
   */
  int32_t extra_topk;
  /**
   * The layer's page-view shift, already in every index.
   */
  int32_t shift;
} V4poolFlashMla;

/**
 * A 128-bit chained block hash (`lo` the low 64 bits: what routers see).
 */
typedef struct V4poolHash {
  /**
   * Bits 0..64.
   */
  uint64_t lo;
  /**
   * Bits 64..128.
   */
  uint64_t hi;
} V4poolHash;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * The variant name of this thread's last error ("" after a success). Valid until the
 * thread's next v4pool call.
 */
const char *v4pool_last_error_variant(void);

/**
 * The message of this thread's last error ("" after a success). Valid until the thread's
 * next v4pool call.
 */
const char *v4pool_last_error_message(void);

/**
 * Size a pool: `v4pool plan`. `dtype` (`fp8`/`bf16`/`flashmla-v4`/`flashmla-v4-p2`/`flashmla-v41`/
 * `flashmla-v41-fp4`) and `indexer` (`fp8`/`fp4`/`bf16`) may be null for the defaults (the
 * model family's rows, as `v4pool plan`: fp8 for V4, flashmla-v41 for V4.1; an fp8
 * indexer); `spec_steps` 0 is the default the CLI and Python take. `model` is a preset name or
 * a `config.json` path (a directory means its `config.json`). A config is read only if it is a regular file of at most 4 MiB: a FIFO or
 * device is refused unread (`NotAFile`), a larger file refused (`TooLarge`); nothing blocks.
 *
 * # Safety
 * Strings are null or NUL-terminated; `out_plan` points to writable storage for a handle.
 */
enum V4poolStatus v4pool_plan_new(const char *model,
                                  uint64_t budget_bytes,
                                  int64_t max_seqs,
                                  const char *dtype,
                                  const char *indexer,
                                  int64_t spec_steps,
                                  struct V4poolPlan **out_plan);

/**
 * Free a plan (null is ignored).
 *
 * # Safety
 * `plan` is null or from `v4pool_plan_new`, freed once.
 */
void v4pool_plan_free(struct V4poolPlan *plan);

/**
 * The plan as the JSON text of `v4pool plan --json`; free it with `v4pool_string_free`.
 *
 * # Safety
 * `plan` is a live plan; `out_json` is writable.
 */
enum V4poolStatus v4pool_plan_json(const struct V4poolPlan *plan, char **out_json);

/**
 * The plan's main numbers.
 *
 * # Safety
 * `plan` is a live plan; `out_info` is writable.
 */
enum V4poolStatus v4pool_plan_info(const struct V4poolPlan *plan, struct V4poolPlanInfo *out_info);

/**
 * Free a string this library returned (null is ignored).
 *
 * # Safety
 * `s` is null or from this library, freed once.
 */
void v4pool_string_free(char *s);

/**
 * A pool for `plan` on `backend` (`auto`, `host`, `cuda`, `hip`; null = auto) and device
 * `device`; its work goes on `stream` (0: the backend's own).
 *
 * # Safety
 * `plan` is a live plan; `backend` null or NUL-terminated; `out_pool` writable; `stream` a
 * live stream of that device or 0.
 */
enum V4poolStatus v4pool_pool_new(const struct V4poolPlan *plan,
                                  const char *backend,
                                  uint32_t device,
                                  uint64_t stream,
                                  struct V4poolPool **out_pool);

/**
 * Bytes `v4pool_pool_new_external` needs for `plan`.
 *
 * # Safety
 * `plan` is a live plan; `out_bytes` writable.
 */
enum V4poolStatus v4pool_pool_required_bytes(const struct V4poolPlan *plan, uint64_t *out_bytes);

/**
 * A pool whose planes, indexer cache and descriptors live in the caller's memory
 * `ptr .. ptr + bytes` (at least `v4pool_pool_required_bytes`).
 *
 * # Safety
 * As `v4pool_pool_new`, and: the region is memory of that backend's device (host memory
 * for `host`), stays allocated until the pool and every decode handle of it are freed, and
 * nothing else reads or writes it meanwhile except through the pool's views.
 */
enum V4poolStatus v4pool_pool_new_external(const struct V4poolPlan *plan,
                                           const char *backend,
                                           uint32_t device,
                                           uint64_t stream,
                                           uint64_t ptr,
                                           uint64_t bytes,
                                           struct V4poolPool **out_pool);

/**
 * Free a pool (null is ignored); waits for its stream. Decode handles keep it alive.
 *
 * # Safety
 * `pool` is null or from `v4pool_pool_new*`, freed once.
 */
void v4pool_pool_free(struct V4poolPool *pool);

/**
 * Plane `plane` as a view (`rows` = plane rows).
 *
 * # Safety
 * `pool` is live; `out_view` writable.
 */
enum V4poolStatus v4pool_pool_plane(const struct V4poolPool *pool,
                                    uint32_t plane,
                                    struct V4poolView *out_view);

/**
 * Layer `layer`'s view of plane `plane` (index-buffer entries are its rows).
 *
 * # Safety
 * `pool` is live; `out_view` writable.
 */
enum V4poolStatus v4pool_pool_layer_view(const struct V4poolPool *pool,
                                         uint32_t layer,
                                         uint32_t plane,
                                         struct V4poolView *out_view);

/**
 * The view `layer`'s compressed indices are rows of (`Pool::compressed_view`): its layer view
 * of plane 0, or in a packed pool (`flashmla-v41-fp4`) the 288-B fp4 rows from plane row 0
 * (FlashMLA's `extra_k_cache`, shift 0). Refused for a layer without compressed rows.
 *
 * # Safety
 * `pool` is live; `out_view` writable.
 */
enum V4poolStatus v4pool_pool_compressed_view(const struct V4poolPool *pool,
                                              uint32_t layer,
                                              struct V4poolView *out_view);

/**
 * Layer `layer`'s page view of plane `plane` in pages of `page_rows` rows (FlashMLA: 64).
 *
 * # Safety
 * `pool` is live; `out_view` writable.
 */
enum V4poolStatus v4pool_pool_page_view(const struct V4poolPool *pool,
                                        uint32_t layer,
                                        uint32_t plane,
                                        int64_t page_rows,
                                        struct V4poolPageView *out_view);

/**
 * Row of `layer`'s view holding ring entry `ring_pos` of the slot at `position`.
 *
 * # Safety
 * `pool` is live; `out_row` writable.
 */
enum V4poolStatus v4pool_pool_window_index(const struct V4poolPool *pool,
                                           uint32_t layer,
                                           int64_t position,
                                           int64_t ring_pos,
                                           int64_t *out_row);

/**
 * Hand out a slot (its compressor state initialised on the pool's stream).
 *
 * # Safety
 * `pool` is live; `out_slot` writable.
 */
enum V4poolStatus v4pool_pool_alloc_slot(const struct V4poolPool *pool,
                                         struct V4poolSlot *out_slot);

/**
 * Return a slot.
 *
 * # Safety
 * `pool` is live.
 */
enum V4poolStatus v4pool_pool_free_slot(const struct V4poolPool *pool, struct V4poolSlot slot);

/**
 * Hand out a block.
 *
 * # Safety
 * `pool` is live; `out_block` writable.
 */
enum V4poolStatus v4pool_pool_alloc_block(const struct V4poolPool *pool,
                                          struct V4poolBlock *out_block);

/**
 * Return a block.
 *
 * # Safety
 * `pool` is live.
 */
enum V4poolStatus v4pool_pool_free_block(const struct V4poolPool *pool, struct V4poolBlock block);

/**
 * Copy `len` bytes of plane `plane` from `offset` to host memory `dst` (waits).
 *
 * # Safety
 * `pool` is live; `dst` holds `len` writable bytes.
 */
enum V4poolStatus v4pool_pool_read_plane(const struct V4poolPool *pool,
                                         uint32_t plane,
                                         uint64_t offset,
                                         uint8_t *dst,
                                         size_t len);

/**
 * Copy `len` host bytes from `src` into plane `plane` at `offset`.
 *
 * # Safety
 * `pool` is live; `src` holds `len` readable bytes.
 */
enum V4poolStatus v4pool_pool_write_plane(const struct V4poolPool *pool,
                                          uint32_t plane,
                                          uint64_t offset,
                                          const uint8_t *src,
                                          size_t len);

/**
 * Decode index buffers for `pool` sized for `cap` (`cap->win` / `cap->index_topk` 0: the
 * pool's spec's window / top-k, the model's).
 *
 * # Safety
 * `pool` is live; `cap` readable; `out_decode` writable.
 */
enum V4poolStatus v4pool_decode_new(const struct V4poolPool *pool,
                                    const struct V4poolDecodeCapacity *cap,
                                    struct V4poolDecode **out_decode);

/**
 * Decode index buffers for `pool` sized for `cap` (0 for the window or top-k: the pool's spec's),
 * in FlashMLA's convention (index-buffers.md
 * §3f: the build and `v4pool_decode_csa_pack` write FlashMLA's operands, read with
 * `v4pool_decode_flashmla`) at `widths` (null: the narrowest the capacity allows).
 *
 * # Safety
 * `pool` is live; `cap` readable; `widths` null or readable; `out_decode` writable.
 */
enum V4poolStatus v4pool_decode_new_flashmla(const struct V4poolPool *pool,
                                             const struct V4poolDecodeCapacity *cap,
                                             const struct V4poolFlashMlaWidths *widths,
                                             struct V4poolDecode **out_decode);

/**
 * Layer `layer`'s FlashMLA operands of a decode path from `v4pool_decode_new_flashmla`
 * (`NoFlashMla` for a CSR path).
 *
 * # Safety
 * `decode` is live; `out_ops` writable.
 */
enum V4poolStatus v4pool_decode_flashmla(const struct V4poolDecode *decode,
                                         uint32_t layer,
                                         struct V4poolFlashMla *out_ops);

/**
 * Free decode buffers (null is ignored); waits for the streams they were used on.
 *
 * # Safety
 * `decode` is null or from `v4pool_decode_new`, freed once, and no captured graph that
 * names its buffers runs after.
 */
void v4pool_decode_free(struct V4poolDecode *decode);

/**
 * Stage one decode step of `batch` sequences: slot positions, context lengths after the
 * step, tokens per sequence, and block tables (`batch × table_stride` int32, row-major;
 * null when the tables are resident). One copy on the pool's stream; `out_tokens` gets the
 * real token count (may be null).
 *
 * # Safety
 * `decode` is live and no other call uses it meanwhile; the three arrays hold `batch`
 * elements; `block_tables` is null or holds `batch * table_stride` elements; `out_tokens` is
 * null or writable.
 */
enum V4poolStatus v4pool_decode_stage(struct V4poolDecode *decode,
                                      size_t batch,
                                      const int64_t *positions,
                                      const int64_t *context_lens,
                                      const int64_t *num_tokens,
                                      const int32_t *block_tables,
                                      size_t table_stride,
                                      size_t *out_tokens);

/**
 * Queue the index build on `stream` (0: the pool's stream; another stream must be ordered
 * after the staging): one launch with fixed pointers, capturable in a graph.
 *
 * # Safety
 * `decode` is live and no other call uses it meanwhile; `stream` a live stream of the pool's
 * device or 0.
 */
enum V4poolStatus v4pool_decode_build(struct V4poolDecode *decode, uint64_t stream);

/**
 * Device address and int32 length of a class's buffer: `which` a `V4poolDecodeBuffer`,
 * `cls` 0 dense, 1 CSA, 2 HCA.
 *
 * # Safety
 * `decode` is live; `out_buffer` writable.
 */
enum V4poolStatus v4pool_decode_buffer(const struct V4poolDecode *decode,
                                       uint32_t which,
                                       uint32_t cls,
                                       struct V4poolBuffer *out_buffer);

/**
 * Wait for every stream the decode buffers were used on.
 *
 * # Safety
 * `decode` is live.
 */
enum V4poolStatus v4pool_decode_synchronize(const struct V4poolDecode *decode);

/**
 * The chained hashes of every full block of `tokens` (`block_size` tokens each) in the
 * namespace of `namespace_label` (as `KvManager`'s), chained from `parent` (null: the first
 * block); writes at most `out_cap` of them and their count to `out_len`.
 *
 * # Safety
 * `namespace_label` is NUL-terminated; `tokens` holds `n_tokens`; `parent` is null or
 * readable; `out_hashes` holds `out_cap` writable hashes; `out_len` writable.
 */
enum V4poolStatus v4pool_block_hashes(const char *namespace_label,
                                      const uint32_t *tokens,
                                      size_t n_tokens,
                                      size_t block_size,
                                      const struct V4poolHash *parent,
                                      struct V4poolHash *out_hashes,
                                      size_t out_cap,
                                      size_t *out_len);

/**
 * A publisher on `endpoint` (bound when it has a wildcard or is `ipc://` / `inproc://`,
 * connected to otherwise), with a replay socket on `replay_endpoint` (null: none), every
 * message's first frame `topic` (null: empty), events encoded as `encoding_code` (a
 * `V4poolEventEncoding`).
 *
 * # Safety
 * Strings are null or NUL-terminated; `out_events` writable.
 */
enum V4poolStatus v4pool_events_new(const char *endpoint,
                                    const char *replay_endpoint,
                                    const char *topic,
                                    uint32_t encoding_code,
                                    uint32_t dp_rank,
                                    uint32_t block_size,
                                    struct V4poolEvents **out_events);

/**
 * The endpoint subscribers connect to (a bound wildcard port resolved); owned by `events`.
 *
 * # Safety
 * `events` is live.
 */
const char *v4pool_events_endpoint(const struct V4poolEvents *events);

/**
 * The replay endpoint, or null; owned by `events`.
 *
 * # Safety
 * `events` is live.
 */
const char *v4pool_events_replay_endpoint(const struct V4poolEvents *events);

/**
 * Add a `BlockStored` event: `n` blocks (a chain, in order) after `parent` (null: none),
 * with their tokens (`n_tokens` = `n` × block size, or 0 for none), in `medium_code` (a
 * `V4poolMedium`).
 *
 * # Safety
 * `events` is live and no other call uses it meanwhile; `hashes` holds `n`; `parent` is null
 * or readable; `tokens` holds `n_tokens`.
 */
enum V4poolStatus v4pool_events_stored(struct V4poolEvents *events,
                                       const struct V4poolHash *hashes,
                                       size_t n,
                                       const struct V4poolHash *parent,
                                       const uint32_t *tokens,
                                       size_t n_tokens,
                                       uint32_t medium_code);

/**
 * Add a `BlockRemoved` event: `n` blocks left `medium`.
 *
 * # Safety
 * `events` is live and no other call uses it meanwhile; `hashes` holds `n`.
 */
enum V4poolStatus v4pool_events_removed(struct V4poolEvents *events,
                                        const struct V4poolHash *hashes,
                                        size_t n,
                                        uint32_t medium_code);

/**
 * Add an `AllBlocksCleared` event.
 *
 * # Safety
 * `events` is live and no other call uses it meanwhile.
 */
enum V4poolStatus v4pool_events_cleared(struct V4poolEvents *events);

/**
 * Send the events added since the last flush as one batch; its sequence number to
 * `out_seq` (-1: there was nothing to send).
 *
 * # Safety
 * `events` is live and no other call uses it meanwhile; `out_seq` writable.
 */
enum V4poolStatus v4pool_events_flush(struct V4poolEvents *events, int64_t *out_seq);

/**
 * Close the publisher's sockets (unsent events are dropped).
 *
 * # Safety
 * `events` is null or a live handle, not used after.
 */
void v4pool_events_free(struct V4poolEvents *events);

/**
 * A top-k buffer for `max_tokens` rows of `index_topk` on `pool` (sized like the decode
 * handle it serves).
 *
 * # Safety
 * `pool` is live; `out_topk` writable.
 */
enum V4poolStatus v4pool_csa_topk_new(const struct V4poolPool *pool,
                                      size_t max_tokens,
                                      size_t index_topk,
                                      struct V4poolCsaTopk **out_topk);

/**
 * Free a top-k buffer (null is a no-op).
 *
 * # Safety
 * `topk` is null or a live handle, not used afterwards.
 */
void v4pool_csa_topk_free(struct V4poolCsaTopk *topk);

/**
 * One CSA layer's decode translate-pack: `ids` holds `rows × width` ids (`bits` 32: int32,
 * 64: int64), row `t` the indexer's top-k of the staged batch's token `t`; every id the pack
 * reads is checked (`0 <= id < (pos + 1) / 4`) before the launch on the pool's stream.
 *
 * # Safety
 * `decode` and `topk` are live handles of the same pool; `ids` holds `rows × width` elements
 * of the named width (or is null with `rows × width == 0`).
 */
enum V4poolStatus v4pool_decode_csa_pack(const struct V4poolDecode *decode,
                                         const struct V4poolCsaTopk *topk,
                                         const void *ids,
                                         uint32_t bits,
                                         size_t rows,
                                         size_t width);

/**
 * The ABI version of the library that is loaded (`V4POOL_ABI_VERSION` of the header it was
 * built with). A caller compares it with its own header's `V4POOL_ABI_VERSION` at start-up.
 */
uint32_t v4pool_abi_version(void);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* V4POOL_H */
