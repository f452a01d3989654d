"""v4pool from Python in one page, on the host backend (no GPU needed; on a GPU pass
backend="cuda" and the engine's stream, and hand the views to torch with torch.from_dlpack).

1. plan a pool for a byte budget, 2. views of its memory (DLPack, no copies), 3. a request
manager serving a prompt and then the same conversation's next turn from the cache, 4. the
decode index buffers of one step built for the manager's request.

Run: python3 examples/quickstart.py   (after `pip install .` in a checkout)
Exits non-zero if a call fails or the second turn misses the cache.
"""

import numpy as np

import v4pool


def main():
    # 1. Plan: V4-Flash, fp8 KV, 4 sequences in 256 MiB (fields of `v4pool plan --json`).
    plan = v4pool.plan(model="v4-flash", budget="256MiB", max_seqs=4)
    print(f"plan: {plan.to_dict()['num_blocks']} blocks of compressed history, "
          f"{plan.to_dict()['num_slots']} slots, planes {plan.plane_widths} B wide")

    # 2. The pool and a view of layer 0's NoPE plane: a DLPack object aliasing the pool
    #    (numpy here, torch.from_dlpack on a GPU).
    pool = v4pool.Pool(plan, backend="host")
    nope = np.from_dlpack(pool.layer_view(0, 0))
    print(f"layer 0 NoPE view: {nope.dtype} {nope.shape}")

    # 3. The request manager: prefix reuse with state checkpoints, the elastic split. Prompts
    #    are token lists; it hashes their full blocks (namespaced by the model revision).
    mgr = v4pool.KvManager(pool, policy="elastic", namespace="deepseek-v4-flash@quickstart")
    bs = mgr.block_size
    turn1 = list(range(1000, 1000 + 3 * bs + 40))
    answer = list(range(9000, 9000 + 60))
    serve(mgr, turn1, answer)
    turn2 = turn1 + answer + list(range(5000, 5100))
    print(f"turn 2: match_prefix says {mgr.match_prefix(turn2)} tokens are cached")
    rid, hit = serve(mgr, turn2, [], keep=True)
    if hit < (len(turn1) + len(answer)) // bs * bs:
        raise SystemExit(f"turn 2 hit {hit} tokens: expected the whole of turn 1")

    # 4. The running request's next decode step: its block, then its slot, context and block
    #    table staged, every index buffer built in one launch, the HCA layers' CSR read back.
    mgr.allocate(rid, 1)
    context = mgr.computed_tokens(rid) + 1  # the context after this step
    dec = pool.decode(max_seqs=4, max_blocks_per_seq=16)
    table = np.zeros((1, 16), dtype=np.int32)
    ids = mgr.block_table(rid)
    table[0, :len(ids)] = ids
    dec.stage(np.array([mgr.slot_position(rid)], dtype=np.int64),
              np.array([context], dtype=np.int64), block_tables=table)
    dec.build()
    indptr = np.from_dlpack(dec.indptr("hca"))
    print(f"decode step at context {context}: {indptr[1] - indptr[0]} HCA indices "
          f"({context // 128} compressed rows + {min(context, 128)} window rows)")
    # ... the forward writes the token's rows and attends through these buffers, then:
    mgr.commit(rid, 1)
    mgr.complete_inflight()
    mgr.finish(rid)
    s = mgr.stats()
    print(f"stats: admissions {s['admissions']}, hits {s['hits']}, hit tokens {s['hit_tokens']}")
    mgr.check_invariants()

    # Errors are typed: .variant is the Rust error's variant name.
    try:
        pool.layer_view(0, 7)
    except v4pool.V4PoolError as e:
        print(f"error as expected: {e.variant}: {e}")


def serve(mgr, prompt, generated, keep=False):
    """A request from arrival to finish (or kept running with `keep`): admit with its hit,
    chunked prefill, then one decode step per generated token. Returns (id, hit tokens)."""
    rid = mgr.add_request(prompt)
    hit = mgr.admit(rid)  # a slot, restored from the hit's checkpoint; prefill resumes there
    print(f"request of {len(prompt)} tokens admitted with {hit} from the cache")
    while (n := mgr.prefill_stop(rid, 512)) > 0:
        step(mgr, rid, n)
    parent = (mgr.block_hashes(prompt) or [None])[-1]
    context = list(prompt)
    for token in generated:  # each token's KV is written by the step that takes it as input
        context.append(token)
        if len(context) % mgr.block_size == 0:  # it completes a block: name it for the cache
            h = mgr.block_hashes(context[-mgr.block_size:], parent)
            mgr.extend_hashes(rid, h)
            parent = h[-1]
        step(mgr, rid, 1)
    if not keep:
        mgr.finish(rid)  # the slot goes back; the blocks and checkpoints stay cached
        mgr.rebalance()
    return rid, hit


def step(mgr, rid, n):
    """Allocate, run the forward (here: nothing; it would read mgr.block_table(rid) and
    mgr.slot_position(rid)), commit, and complete the step's checkpoint copies."""
    mgr.allocate(rid, n)
    mgr.commit(rid, n)
    mgr.complete_inflight()


if __name__ == "__main__":
    main()
