//! The request loop a scheduler runs over v4pool's request-level manager, on the host
//! backend: plan a pool for a byte budget, put a `KvManager` over it, and serve three
//! requests — a first turn, another user behind the same system prompt, and the first
//! conversation's second turn — with chunked prefill, decode, commit and finish. The second
//! and third requests are served from the cache (exact prefix reuse: their slot is restored
//! from a checkpoint of the compressor state and sliding windows, their blocks referenced).
//!
//! Where a real engine runs its forward pass, this example prints the block table and slot
//! position the forward would use (`examples/decode_step.rs` shows that step: the decode
//! index buffers built from them). Exits non-zero if any call fails or a hit is missing.
//!
//! Run: `cargo run --release --example manager_loop`.

use std::error::Error;
use std::sync::Arc;
use v4pool::prelude::*;

/// Prefill tokens a step may spend (the scheduler's token budget).
const CHUNK: u64 = 512;

// Field by field on a default config: see the note at `config` below.
#[allow(clippy::field_reassign_with_default)]
fn main() -> Result<(), Box<dyn Error>> {
    // 1. Plan and pool: V4-Flash with one MTP draft, fp8 KV, up to 8 sequences in 1 GiB, on
    //    the host backend (on a GPU: `backend::select(BackendChoice::Auto)` and the engine's
    //    stream; nothing else changes).
    let model = ModelShape::v4_flash(1)?;
    let plan = plan(&model, &PlanRequest::new(KvDtype::Fp8, IndexerDtype::Fp8, 8, 1 << 30))?;
    let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
    let pool = Arc::new(Pool::new(backend, PoolSpec::from_plan(&plan)?, Stream::DEFAULT)?);

    // 2. The manager owns the split between blocks and slots (elastic: slots grow with the
    //    running batch and go back to blocks when idle) and the prefix cache. A permanent
    //    checkpoint every 4 blocks, so a 1,024-token system prompt ends at one.
    // Set field by field, not `ManagerConfig { .., ..Default::default() }`: the config
    // structs become `#[non_exhaustive]` (issue 44), which forbids that form outside the crate.
    let mut config = ManagerConfig::default();
    config.checkpoint_every = 4;
    let mut m = KvManager::new(pool, config, Box::new(ElasticPolicy::default()))?;
    let bs = m.block_size();
    // Hashes are namespaced by what makes KV differ beyond the tokens (model revision, LoRA).
    let ns = Namespace::from_label("deepseek-v4-flash@example");
    let c = m.pool().counts()?;
    println!("pool: {} blocks of {bs} tokens beside {} slots", c.num_blocks, c.num_slots);

    // 3. Three prompts: a shared 1,024-token system prompt, then each user's own text.
    let system: Vec<u32> = (0..1024).map(|i| 1000 + i % 7919).collect();
    let turn1 = [system.clone(), text(1, 476)].concat();
    let other_user = [system.clone(), text(2, 300)].concat();

    // First turn: no hit; 1,500 prompt tokens, 300 generated.
    let (a, answer) = serve(&mut m, ns, &turn1, 300, "turn 1")?;
    require(a == 0, "the first request hit an empty cache")?;

    // Another user behind the same system prompt: served from the checkpoint at 1,024.
    let (b, _) = serve(&mut m, ns, &other_user, 50, "other user")?;
    require(b == 1024, "the shared system prompt did not hit at 1,024 tokens")?;

    // The first conversation's second turn: its prompt is turn 1 + the answer + new text;
    // the hit reaches the last full block turn 1 computed (a rolling checkpoint at its end).
    let turn2 = [turn1, answer, text(3, 200)].concat();
    let (c, _) = serve(&mut m, ns, &turn2, 20, "turn 2")?;
    let computed = (1500 + 300) / bs * bs;
    require(c == computed, "turn 2 did not hit where turn 1 stopped")?;

    let s = m.stats();
    println!(
        "admissions {}, hits {}, tokens from cache {}, checkpoints stored {}, cached blocks {}",
        s.admissions, s.hits, s.hit_tokens, s.checkpoints_stored, s.cached_blocks
    );
    m.check_invariants()?;
    Ok(())
}

/// One request from arrival to finish, as a scheduler drives it (one request at a time here;
/// an engine interleaves these calls over its batch). Returns the tokens admission served from
/// the cache and the generated tokens.
fn serve(
    m: &mut KvManager,
    ns: Namespace,
    prompt: &[u32],
    max_new: usize,
    what: &str,
) -> Result<(u64, Vec<u32>), Box<dyn Error>> {
    let bs = m.block_size();
    let hashes = chain_hashes(ns, None, prompt, bs as usize);
    // The block a generated block chains from.
    let mut parent = hashes.last().copied();
    // Arrival: the prompt's length and its full blocks' hashes. `match_prefix` peeks at the
    // hit without taking anything.
    let peek = m.match_prefix(&hashes);
    let id = m.add_request(prompt.len() as u64, hashes);
    // Admission: back-pressure first (the hit's own blocks are not room), then a slot,
    // restored from the hit's checkpoint; prefill resumes at `hit_tokens`.
    if !m.may_admit_request(id)? {
        return Err(format!("{what}: no room to admit").into());
    }
    let adm = m.admit(id)?;
    println!(
        "{what}: prompt {} tokens, match_prefix {peek}, admitted with hit {}",
        prompt.len(),
        adm.hit_tokens
    );

    // Prefill in chunks. `prefill_stop` cuts a chunk at the next checkpoint point, so the
    // state is checkpointed there; 0 means the prompt is done.
    loop {
        let n = m.prefill_stop(id, CHUNK)?;
        if n == 0 {
            break;
        }
        step(m, id, n)?;
    }
    // Decode, one token a step (an MTP engine commits its accepted tokens). A step's input is
    // the token the previous step sampled; when it completes a block, that block's hash is
    // given before the step commits it, so the block enters the index (and the rolling
    // checkpoint at its end is stored) and a later turn can hit it.
    let mut generated = Vec::with_capacity(max_new);
    let mut context: Vec<u32> = prompt.to_vec();
    for i in 0..max_new {
        let token = 50_000 + (i as u32 * 31) % 997; // sampled by the step before
        generated.push(token);
        context.push(token);
        if context.len() as u64 % bs == 0 {
            let h = block_hash(ns, parent, &context[context.len() - bs as usize..]);
            m.extend_hashes(id, &[h])?;
            parent = Some(h);
        }
        step(m, id, 1)?;
    }
    // Done: the slot goes back, the blocks stay cached (with their checkpoints); once a step
    // the manager may move the boundary (idle slots back to blocks).
    m.finish(id)?;
    m.rebalance()?;
    Ok((adm.hit_tokens, generated))
}

/// One forward step of `n` tokens of a running request: allocate, forward, commit, and
/// (after the batch's work completed on the engine's stream) complete the checkpoint copies.
fn step(m: &mut KvManager, id: RequestId, n: u64) -> Result<(), Box<dyn Error>> {
    m.allocate(id, n)?;
    // The forward pass reads these, asked afresh each step (a boundary move relocates them):
    let table = m.block_table(id)?;
    let slot = m.slot(id)?.ok_or("a running request has a slot")?;
    let done = m.computed_tokens(id)?;
    if n > 1 {
        println!("  prefill {done}..{}: {} blocks, slot position {}", done + n, table.len(), slot.position);
    }
    m.commit(id, n)?;
    m.complete_inflight()?;
    Ok(())
}

/// `n` tokens of a user's own text (distinct per `seed`).
fn text(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| 20_000 + seed * 1_000 + i % 997).collect()
}

fn require(ok: bool, what: &str) -> Result<(), Box<dyn Error>> {
    if ok {
        Ok(())
    } else {
        Err(what.into())
    }
}
