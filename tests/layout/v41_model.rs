//! DeepSeek-V4.1-Flash end to end on the host: its nested `config.json`, the refusals of
//! `docs/v41.md`, the arena's V4.1 fields and fill values, the capacity numbers (739,840 B
//! per 256-token page, 5,277,696 B per request in bf16), the `v4pool plan` command at
//! 100 GiB, and a pool carved from a V4.1 plan initialising and checkpointing its slots.

use std::process::Command;
use std::sync::Arc;
use v4pool::backend::host::HostBackend;
use v4pool::backend::{Backend, Stream};
use v4pool::geometry::RowForm;
use v4pool::model::{ModelError, ModelFamily, ModelShape};
use v4pool::pool::{Pool, PoolSpec};
use v4pool::raw::arena::{Dtype, Fill, V41_COMPRESS_KV, V41_COMPRESS_SCORE, V41_CURSOR};
use v4pool::sizing::{plan, IndexerDtype, KvDtype, PlanRequest, SizingError};

fn ratios_text(r: &[i64]) -> String {
    let v: Vec<String> = r.iter().map(i64::to_string).collect();
    format!("[{}]", v.join(","))
}

fn v41_ratios() -> Vec<i64> {
    let mut r = vec![0, 0];
    r.extend([2; 18]);
    r.extend([1; 20]);
    r.extend([0, 0, 0]);
    r
}

/// V4.1-Flash's published `config.json` shape: every text key under `text_config`.
fn v41_config(ratios: &[i64], kv: &str, index: &str) -> String {
    format!(
        r#"{{
  "architectures": ["DeepseekV41ForCausalLM"],
  "model_type": "deepseek_v41",
  "torch_dtype": "bfloat16",
  "text_config": {{
    "model_type": "deepseek_v41_text",
    "hidden_size": 4096,
    "num_hidden_layers": 40,
    "num_nextn_predict_layers": 3,
    "compress_ratios": {ratios},
    "kv_source_layer_ids": {kv},
    "index_source_layer_ids": {index},
    "engram_max_ngram_size": 4,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "sliding_window": 128,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk": 512
  }}
}}"#,
        ratios = ratios_text(ratios)
    )
}

fn good_config() -> String {
    v41_config(&v41_ratios(), "[2, 8, 14, 20]", "[2, 8, 14, 20, 24, 28, 32, 36]")
}

#[test]
fn the_nested_config_reads_as_v41() {
    let c = ModelShape::read_config(&good_config(), 0, None).unwrap();
    let m = &c.shape;
    assert_eq!(m.family, ModelFamily::V41);
    assert_eq!((m.num_hidden_layers, m.num_mtp_layers, m.ratios.len()), (40, 3, 43));
    // Ratio 1 is a compressed class in V4.1, not window-only.
    assert_eq!(m.ratios[20..40], [1; 20]);
    assert_eq!(m.ratios[2..20], [2; 18]);
    assert_eq!(m.kv_sources, vec![2, 8, 14, 20]);
    assert_eq!(m.index_sources, vec![2, 8, 14, 20, 24, 28, 32, 36]);
    assert_eq!(m.engram_history, 3);
    assert_eq!(m.draft_layers, vec![40, 41, 42]);
    assert!(c.keys_read.contains(&"text_config") && c.keys_read.contains(&"kv_source_layer_ids"));
    let g = m.geometry_spec(0, 0);
    assert_eq!((g.kv_sources.as_deref(), g.form), (Some(&[2usize, 8, 14, 20][..]), RowForm::Compact));
    // The preset with drafts is the same shape.
    let p = ModelShape::by_name("v4.1-flash-dspark", 0).unwrap();
    assert_eq!(
        (p.ratios.clone(), p.kv_sources.clone(), p.draft_layers.clone()),
        (m.ratios.clone(), m.kv_sources.clone(), m.draft_layers.clone())
    );
    assert_eq!(ModelShape::by_name("v4.1-flash", 0).unwrap().ratios.len(), 40);
}

#[test]
fn ratio_one_stays_window_only_for_v4() {
    // A V4 config writing its window-only layers as 1 (vLLM's V4 test configs).
    let text = r#"{"model_type": "deepseek_v4", "num_hidden_layers": 4, "compress_ratios": [1, 1, 4, 128],
        "sliding_window": 128, "qk_rope_head_dim": 64, "index_head_dim": 128, "index_topk": 512}"#;
    let m = ModelShape::from_config_json(text, 0).unwrap();
    assert_eq!((m.family, m.ratios.clone()), (ModelFamily::V4, vec![0, 0, 4, 128]));
    // V4 keeps its strict ratio vocabulary.
    let text = text.replace("[1, 1, 4, 128]", "[0, 2, 4, 128]");
    assert_eq!(ModelShape::from_config_json(&text, 0), Err(ModelError::UnknownRatio { layer: 1, got: 2 }));
}

#[test]
fn malformed_v41_configs_are_refused() {
    let kv = "[2, 8, 14, 20]";
    let ix = "[2, 8, 14, 20, 24, 28, 32, 36]";
    let read = |text: String| ModelShape::read_config(&text, 0, None).map(|_| ());
    // Drafts must be window-only; the list must cover 43 layers.
    let mut r = v41_ratios();
    r[41] = 2;
    assert_eq!(read(v41_config(&r, kv, ix)), Err(ModelError::DraftNotWindowOnly { layer: 41, got: 2 }));
    assert_eq!(
        read(v41_config(&v41_ratios()[..40], kv, ix)),
        Err(ModelError::RatioCount { got: 40, expected: 43 })
    );
    // A negative ratio; a ratio the block size does not divide is the geometry's refusal.
    let mut r = v41_ratios();
    r[5] = -1;
    assert_eq!(read(v41_config(&r, kv, ix)), Err(ModelError::UnknownRatio { layer: 5, got: -1 }));
    let bad_sources = |kv: &str, ix: &str| match read(v41_config(&v41_ratios(), kv, ix)) {
        Err(ModelError::Sources { key, .. } | ModelError::SourceOwners { key, .. }) => key,
        other => panic!("{kv} {ix}: {other:?}"),
    };
    assert_eq!(bad_sources("[2, 8, 14, 19]", ix), "kv_source_layer_ids"); // 19 is ratio 2, 20 ratio 1
    assert_eq!(bad_sources("[8, 14, 20]", ix), "kv_source_layer_ids"); // layer 2 has no source
    assert_eq!(bad_sources("[8, 2, 14, 20]", ix), "kv_source_layer_ids"); // unsorted
    assert_eq!(bad_sources("[0, 2, 8, 14, 20]", ix), "kv_source_layer_ids"); // a window-only layer
    assert_eq!(bad_sources("[2, 8, 14, 20, 41]", ix), "kv_source_layer_ids"); // a draft layer
    assert_eq!(bad_sources(kv, "[2, 8, 20, 24]"), "kv_source_layer_ids"); // 14 not an index source
    assert_eq!(bad_sources(kv, "[2, 8, 14, 20, 20]"), "index_source_layer_ids");
    // No KV sources (an empty list, or none given): V4.1 shares compressors, so its arena has
    // no owner to hold compressor state. Seen failing before the fix: the config read, so
    // `layout` printed a V4-form layout of it while `plan` refused it (BadModel).
    assert_eq!(bad_sources("[]", ix), "kv_source_layer_ids");
    let absent = good_config().replace("\"kv_source_layer_ids\": [2, 8, 14, 20],", "");
    assert!(!absent.contains("kv_source_layer_ids"));
    assert!(matches!(read(absent), Err(ModelError::Sources { key: "kv_source_layer_ids", .. })));
    // The geometry's refusal arrives as the geometry's error, not its text.
    assert!(matches!(
        read(v41_config(&v41_ratios(), "[8, 2, 14, 20]", ix)),
        Err(ModelError::SourceOwners { key: "kv_source_layer_ids", .. })
    ));
    assert!(matches!(
        read(good_config().replace("\"text_config\": {", "\"text_config\": 5, \"x\": {")),
        Err(ModelError::WrongType { key: "text_config", .. })
    ));
    assert!(matches!(
        read(good_config().replace("\"engram_max_ngram_size\": 4", "\"engram_max_ngram_size\": 0")),
        Err(ModelError::OutOfRange { key: "engram_max_ngram_size", .. })
    ));
    // V4.1 rows are bf16 only.
    let m = ModelShape::by_name("v4.1-flash", 0).unwrap();
    let req = PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 8, 1 << 30);
    assert!(matches!(plan(&m, &req), Err(SizingError::KvDtypeUnsupported { .. })));
}

#[test]
fn arena_fields_and_fill_values() {
    let m = ModelShape::by_name("v4.1-flash", 0).unwrap();
    let layout = v4pool::sizing::PoolLayout::new(&m, KvDtype::Bf16, IndexerDtype::Fp8).unwrap();
    let fields = layout.arena.fields();
    let names: Vec<&str> = fields.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, vec![V41_COMPRESS_KV, V41_COMPRESS_SCORE, V41_CURSOR]);
    // Owners × (max owner ratio + k) × 512 fp32, zero (scores too); cursor (3 + 1) int64.
    assert_eq!((fields[0].layers, fields[0].shape.clone(), fields[0].fill), (4, vec![2, 512], Fill::Zero));
    assert_eq!((fields[1].fill, fields[1].dtype), (Fill::Zero, Dtype::F32));
    assert_eq!(
        (fields[2].shape.clone(), fields[2].dtype, fields[2].fill),
        (vec![4], Dtype::I64, Fill::Cursor)
    );
    assert!(fields.iter().all(|f| f.carried));
    assert_eq!(layout.arena.arena_rows(), 33);
    // DSpark: k = 5 gives rings of 2 + 5 rows.
    let d = ModelShape::by_name("v4.1-flash-dspark", 5).unwrap();
    let dl = v4pool::sizing::PoolLayout::new(&d, KvDtype::Bf16, IndexerDtype::Fp8).unwrap();
    assert_eq!(dl.arena.fields()[0].shape, vec![7, 512]);
    assert_eq!(dl.geometry.entry_rows, 43 * 133);
}

/// The spec's capacity at 100 GiB (compact form in one row space, bf16, FP8 index): 739,840 B per page,
/// 5,277,696 B per request.
#[test]
fn capacity_numbers() {
    let m = ModelShape::by_name("v4.1-flash", 0).unwrap();
    let layout = v4pool::sizing::PoolLayout::new(&m, KvDtype::Bf16, IndexerDtype::Fp8).unwrap();
    assert_eq!(layout.indexer_block_rows().unwrap(), 640);
    assert_eq!(layout.indexer_block_bytes().unwrap(), 84_480);
    assert_eq!(layout.page_bytes().unwrap(), 739_840);
    assert_eq!(layout.slot_bytes().unwrap(), 5_277_696);
    // V4's pages are unchanged by the generalised indexer pricing.
    let f = ModelShape::v4_flash(0).unwrap();
    let fl = v4pool::sizing::PoolLayout::new(&f, KvDtype::Fp8, IndexerDtype::Fp8).unwrap();
    assert_eq!(fl.indexer_block_bytes().unwrap(), 21 * 8_448);
    let f4 = v4pool::sizing::PoolLayout::new(&f, KvDtype::Fp8, IndexerDtype::Fp4).unwrap();
    assert_eq!(f4.indexer_pool_bytes(3).unwrap(), vec![21 * 3 * 4_096, 21 * 3 * 256]);
}

fn temp_config(text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("v4pool-v41-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    std::fs::write(&path, text).unwrap();
    path
}

/// `v4pool plan --model <a V4.1 config.json> --budget 100GiB --max-seqs 256 --dtype bf16`
/// holds at least 34.8 M tokens (the compact form; the envelope form would hold 3.5 M).
#[test]
fn plan_command_holds_the_v41_capacity() {
    let path = temp_config(&good_config());
    let out = Command::new(env!("CARGO_BIN_EXE_v4pool"))
        .args(["plan", "--model"])
        .arg(&path)
        .args(["--budget", "100GiB", "--max-seqs", "256", "--dtype", "bf16", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tokens = v["tokens"].as_i64().unwrap();
    assert!(tokens >= 34_800_000, "tokens {tokens}");
    assert_eq!(v["page_bytes"].as_u64(), Some(739_840));
    // The config's 43 layers all keep a window (drafts included): 33 + 43 × 128 rows,
    // aligned to 2 (the spec's 5,277,696 is the 40-layer request, `capacity_numbers`).
    assert_eq!(v["slot_bytes"].as_u64(), Some(5_538 * 1024));
    assert!(v["total_bytes"].as_u64().unwrap() <= 100 << 30);
    std::fs::remove_file(&path).unwrap();
}

/// A pool from a V4.1 plan on the host backend: views start in the lead and reach their
/// owners' rows, slot state initialises to the V4.1 fill values, and the checkpoint image
/// of a slot round-trips.
#[test]
fn a_v41_pool_initialises_and_checkpoints() {
    let m = ModelShape::by_name("v4.1-flash", 0).unwrap();
    let p = plan(&m, &PlanRequest::new(KvDtype::Bf16, IndexerDtype::Fp8, 2, 64 << 20)).unwrap();
    assert!(p.total_bytes <= 64 << 20);
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let pool = Pool::new(backend.clone(), PoolSpec::from_plan(&p).unwrap(), Stream::DEFAULT).unwrap();
    let g = pool.geometry().unwrap();
    assert_eq!(g.view_lead_rows, 2048);
    let plane = pool.plane_ptr(0).unwrap();
    for l in [0usize, 2, 3, 19, 20, 39] {
        let v = pool.layer_view(l, 0).unwrap();
        let base = g.layer_base_row(l).unwrap();
        assert_eq!(v.ptr as i64 - plane as i64, base * 1024, "layer {l}");
        assert_eq!(v.rows, g.plane_rows - base);
    }
    // A fresh slot's state: compressor rings zero, the cursor 0 then three −1.
    let lease = pool.alloc_slot().unwrap();
    let arena = &pool.spec().arena;
    let read = |name: &str, len: usize| {
        let (plane, offset) = arena.field_place(arena.field_index(name).unwrap()).unwrap();
        let mut bytes = vec![0x5au8; len];
        pool.read_slot(lease.handle, plane, offset, &mut bytes).unwrap();
        bytes
    };
    let cursor: Vec<i64> =
        read(V41_CURSOR, 32).chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(cursor, vec![0, -1, -1, -1]);
    assert!(read(V41_COMPRESS_SCORE, 4 * 2 * 512 * 4).iter().all(|&b| b == 0));
    // Checkpoint, scribble, restore: the slot's carried bytes come back.
    let (cplane, coff) = arena.field_place(arena.field_index(V41_CURSOR).unwrap()).unwrap();
    pool.write_slot(lease.handle, cplane, coff, &7i64.to_le_bytes()).unwrap();
    let image = pool.checkpoint(lease.handle).unwrap();
    pool.write_slot(lease.handle, cplane, coff, &[0xffu8; 32]).unwrap();
    pool.restore(lease.handle, &image).unwrap();
    let cursor: Vec<i64> =
        read(V41_CURSOR, 32).chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(cursor, vec![7, -1, -1, -1]);
    assert!(image.layout_id().to_string().starts_with("dsv41-v4pool-compact-v1:"), "{}", image.layout_id());
}

/// A V4.1 pool carved empty for a manager: `positions` slots' rows of plane.
fn v41_manager_pool(positions: i64) -> Arc<Pool> {
    let m = ModelShape::by_name("v4.1-flash", 0).unwrap();
    let layout = v4pool::sizing::PoolLayout::new(&m, KvDtype::Bf16, IndexerDtype::Fp8).unwrap();
    let g = layout.carve(0, 0, positions * layout.geometry.slot_rows).unwrap();
    let spec = PoolSpec::from_layout(&layout, g).unwrap();
    Arc::new(Pool::new(Arc::new(HostBackend::new()), spec, Stream::DEFAULT).unwrap())
}

/// Random bytes for a seed, from the tests' generator (`tests/common`'s, reached directly).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    v4pool::sim::Rng::new(seed).bytes(len)
}

/// The slot's checkpoint image ranges `(offset in plane 0, len)`.
fn image_ranges(pool: &Pool, position: i64) -> Vec<(u64, u64)> {
    let (start, _) = pool.spec().geometry.slot_span(position).unwrap();
    pool.checkpoint_ranges().unwrap()[0].iter().map(|&(off, len)| (start as u64 * 1024 + off, len)).collect()
}

fn read(pool: &Pool, ranges: &[(u64, u64)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(off, len) in ranges {
        let mut b = vec![0u8; len as usize];
        pool.read_plane(0, off, &mut b).unwrap();
        out.extend(b);
    }
    out
}

/// The manager on a V4.1 pool, unchanged: a request's state and full blocks written by the
/// host, a checkpoint taken at 1,024 tokens, a second request with the same prefix admitted
/// with a 1,024-token hit whose restored image and blocks are the first request's bytes; the
/// boundary moves and the transfer regions describe the one plane.
#[test]
fn the_manager_checkpoints_and_transfer_regions_work_on_a_v41_pool() {
    use v4pool::manager::{chain_hashes, ElasticPolicy, KvManager, ManagerConfig, Namespace};
    let pool = v41_manager_pool(12);
    let cfg = ManagerConfig::default().with_checkpoint_every(2).with_rolling(true);
    let mut m = KvManager::new(pool.clone(), cfg, Box::new(ElasticPolicy::default())).unwrap();
    let tokens: Vec<u32> = (0..1400u32).map(|i| i.wrapping_mul(2_654_435_761) >> 7).collect();
    let hashes = chain_hashes(Namespace::from_label("v4.1-flash@test"), None, &tokens, 256);
    let block_bytes = pool.spec().geometry.block_bytes(1024);
    let a = m.add_request(1400, hashes.clone());
    m.admit(a).unwrap();
    let mut done = 0u64;
    while done < 1024 {
        let n = m.prefill_stop(a, 512).unwrap().min(1024 - done);
        m.allocate(a, n).unwrap();
        let slot = m.slot(a).unwrap().unwrap();
        let table = m.block_table(a).unwrap();
        // The forward: the slot's carried state is a function of the history; full blocks
        // get rows that are a function of their hash.
        let img = image_ranges(&pool, slot.position);
        let total: u64 = img.iter().map(|r| r.1).sum();
        let bytes = pattern(done + n, total as usize);
        let mut at = 0;
        for &(off, len) in &img {
            pool.write_plane(0, off, &bytes[at..at + len as usize]).unwrap();
            at += len as usize;
        }
        for b in done / 256..(done + n) / 256 {
            let id = u64::from(table[b as usize] as u32);
            pool.write_plane(
                0,
                id * block_bytes,
                &pattern(hashes[b as usize].0 as u64, block_bytes as usize),
            )
            .unwrap();
        }
        m.commit(a, n).unwrap();
        m.complete_inflight().unwrap();
        done += n;
    }
    let pos_a = m.slot(a).unwrap().unwrap().position;
    let at_1024 = read(&pool, &image_ranges(&pool, pos_a));
    let blocks_a: Vec<i32> = m.block_table(a).unwrap()[..4].to_vec();
    m.finish(a).unwrap();
    m.check_invariants().unwrap();
    // Scribble over the freed slot, so that only a restore can bring the image back.
    let (s0, s1) = pool.spec().geometry.slot_span(pos_a).unwrap();
    pool.write_plane(0, s0 as u64 * 1024, &pattern(999, ((s1 - s0) * 1024) as usize)).unwrap();
    let b = m.add_request(1100, hashes[..4].to_vec());
    let adm = m.admit(b).unwrap();
    assert_eq!(adm.hit_tokens, 1024);
    m.complete_inflight().unwrap();
    assert_eq!(read(&pool, &image_ranges(&pool, adm.slot.position)), at_1024, "restored image");
    let table_b = m.block_table(b).unwrap();
    for (i, &blk) in table_b[..4].iter().enumerate() {
        let mut got = vec![0u8; block_bytes as usize];
        pool.read_plane(0, u64::from(blk as u32) * block_bytes, &mut got).unwrap();
        assert_eq!(got, pattern(hashes[i].0 as u64, block_bytes as usize), "block {i}");
    }
    assert_eq!(table_b[..4], blocks_a[..], "the cached blocks are shared");
    m.rebalance().unwrap();
    m.check_invariants().unwrap();
    let regions = pool.transfer_regions(&v4pool::transfer::TransferConfig::new(true, 1));
    let r = regions.unwrap();
    assert_eq!(r.slot_regions.len(), 1);
    m.finish(b).unwrap();
    m.check_invariants().unwrap();
}
