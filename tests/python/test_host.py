"""The Python module on the host backend: plans, views aliasing the planes, errors, the
decode index buffers, pools over engine memory. CI runs it against the installed wheel."""

import gc
import json
import os
import subprocess

import numpy as np
import pytest

import v4pool

BUDGET = "256MiB"
RNG = np.random.default_rng(20261130)


@pytest.fixture(scope="module")
def plan():
    return v4pool.plan(model="v4-flash", budget=BUDGET, max_seqs=4)


@pytest.fixture()
def pool(plan):
    return v4pool.Pool(plan, backend="host")


def layer_of(pool, ratio):
    return pool.ratios.index(ratio)


# ---- plan --------------------------------------------------------------------------------


def test_plan_has_the_cli_fields(plan):
    d = plan.to_dict()
    assert d["num_slots"] == 4
    assert plan.plane_rows == d["plane_rows"] > 0
    assert plan.plane_widths == [512, 128]
    assert json.loads(plan.to_json()) == d
    cli = os.environ.get("V4POOL_CLI")
    if not cli:
        pytest.skip("V4POOL_CLI not set: no `v4pool` binary to compare with")
    out = subprocess.run(
        [cli, "plan", "--model", "v4-flash", "--budget", BUDGET, "--max-seqs", "4", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    assert json.loads(out) == d


def test_plan_options(plan):
    bf16 = v4pool.plan(model="v4-flash", budget=256 << 20, max_seqs=4, dtype="bf16")
    assert bf16.plane_widths == [1024]
    k1 = v4pool.plan(model="v4-flash", budget=BUDGET, max_seqs=4, spec_steps=1)
    assert k1.ring_slots == plan.ring_slots + 1
    with pytest.raises(AttributeError):
        plan.no_such_field


def test_v41_preset_plans_in_bf16():
    p = v4pool.plan(model="v4.1-flash", budget=100 << 30, max_seqs=256, dtype="bf16")
    assert p.page_bytes == 739_840 and p.slot_bytes == 5_277_696
    assert p.tokens >= 34_800_000
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.plan(model="v4.1-flash-dspark", budget=100 << 30, max_seqs=256, dtype="fp8")
    assert e.value.variant == "KvDtypeUnsupported"


@pytest.mark.parametrize("model, kv", [("v4-flash", "fp8"), ("v4.1-flash", "flashmla-v41")])
def test_plan_defaults_are_the_clis(model, kv):
    # defect43 row 18: Python defaulted to fp8 rows (a V4.1 model was KvDtypeUnsupported) and
    # its spec_steps default was its own; both are now the library's, which the CLI takes too.
    p = v4pool.plan(model=model, budget="8GiB", max_seqs=16)
    d = p.to_dict()
    assert d["kv_dtype"] == kv and d["spec_steps"] == 0
    cli = os.environ.get("V4POOL_CLI")
    if not cli:
        pytest.skip("V4POOL_CLI not set: no `v4pool` binary to compare with")
    out = subprocess.run(
        [cli, "plan", "--model", model, "--budget", "8GiB", "--max-seqs", "16", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    assert json.loads(out) == d


def test_v41_plans_from_its_name_alone_and_every_default_is_the_specs():
    # issue 44 item 1: `plan(model="v4.1-flash")` plans with nothing else named, and the window,
    # index top-k and MTP steps a pool, its manager, `Pool.decode` and `Forward` default to are
    # the plan's spec's (`kv_spec`, the same object `v4pool plan --json` prints).
    spec = v4pool.plan(model="v4.1-flash").kv_spec
    assert (spec["family"], spec["kv_dtype"], spec["row_format"]) == ("v4.1", "flashmla-v41", "flashmla-v41")
    assert spec["window"] > 0 and spec["index_topk"] > 0 and spec["spec_steps"] == 0
    for steps in (0, 1):
        p = v4pool.plan(model="v4.1-flash", budget=BUDGET, max_seqs=2, spec_steps=steps)
        s = p.kv_spec
        assert s == dict(spec, spec_steps=steps)
        pool = v4pool.Pool(p, backend="host")
        assert pool.kv_spec == s
        mgr = v4pool.KvManager(pool)
        assert mgr.kv_spec == s
        del mgr
        cap = pool.decode(max_seqs=2, max_blocks_per_seq=2).capacity()
        assert (cap["win"], cap["index_topk"], cap["max_tokens"]) == (s["window"], s["index_topk"], 2 * (1 + steps))
        fcap = v4pool.Forward(pool, 2, 2, 2).capacity()
        assert (fcap["win"], fcap["index_topk"]) == (s["window"], s["index_topk"])
        cli = os.environ.get("V4POOL_CLI")
        if cli:
            out = subprocess.run(
                [cli, "plan", "--model", "v4.1-flash", "--budget", BUDGET, "--max-seqs", "2",
                 "--spec-steps", str(steps), "--json"],
                check=True, capture_output=True, text=True,
            ).stdout
            assert json.loads(out)["kv_spec"] == s
    if not os.environ.get("V4POOL_CLI"):
        pytest.skip("V4POOL_CLI not set: the CLI's kv_spec not compared")


def test_plan_for_gfx942_takes_what_atom_reads_there():
    # docs/amd.md: bf16 main KV (ATOM's fp8 KV is gfx950/gfx1250 only) and ATOM's preshuffled
    # e4m3fnuz indexer; the fp8 main KV refused, saying why.
    p = v4pool.plan(model="v4-flash", budget=BUDGET, max_seqs=4, arch="gfx942")
    d = p.to_dict()
    assert (d["kv_dtype"], d["indexer_dtype"], d["arch"]) == ("bf16", "atom-fp8-fnuz", "gfx942")
    assert p.plane_widths == [1024] and ":index=atom-fp8-fnuz:" in d["layout_id"]
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.plan(model="v4-flash", budget=BUDGET, max_seqs=4, arch="gfx942", dtype="fp8")
    assert e.value.variant == "UnreadableOnArch" and "gfx950/gfx1250" in e.value.message
    pool = v4pool.Pool(p, backend="host")
    # A view of gfx942's fp8 exports DLPack's float8_e4m3fnuz (type code 11).
    assert pool.plane(0, dtype="float8_e4m3fnuz").dtype == "float8_e4m3fnuz"


@pytest.mark.parametrize(
    "kwargs, variant",
    [
        (dict(model="v4-nope"), "UnknownPreset"),
        (dict(arch="gfx1100"), "BadValue"),
        (dict(budget="1MiB"), "BudgetTooSmall"),
        (dict(budget="12 parsecs"), "UnknownUnit"),
        (dict(dtype="fp16"), "BadValue"),
        (dict(indexer="int4"), "BadValue"),
    ],
)
def test_plan_errors_carry_the_variant(kwargs, variant):
    args = dict(model="v4-flash", budget=BUDGET, max_seqs=4)
    args.update(kwargs)
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.plan(**args)
    assert e.value.variant == variant
    assert e.value.message and str(e.value) == e.value.message
    assert isinstance(e.value, Exception)


# ---- views -------------------------------------------------------------------------------


def test_pool_errors_carry_the_variant(plan, pool):
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.Pool(plan, backend="tpu")
    assert e.value.variant == "UnknownBackendName"
    with pytest.raises(v4pool.V4PoolError) as e:
        pool.layer_view(layer_of(pool, 4), 2)
    assert e.value.variant == "NoSuchPlane"
    with pytest.raises(v4pool.V4PoolError) as e:
        pool.plane(5)
    assert e.value.variant == "NoSuchPlane"
    with pytest.raises(v4pool.V4PoolError) as e:
        pool.read_plane(0, pool.plane_rows * 512 - 4, 8)
    assert e.value.variant == "PlaneRange"
    slot = pool.alloc_slot()
    pool.free_slot(slot)
    with pytest.raises(v4pool.V4PoolError) as e:
        pool.free_slot(slot)
    assert e.value.variant in ("StaleSlot", "NotHeld", "DoubleFree", "StaleHandle"), e.value.variant


def test_views_are_dlpack_objects(pool):
    p0, p1 = pool.plane(0), pool.plane(1)
    assert p0.dtype == "uint8" and p0.shape == [pool.plane_rows, 512]
    assert p1.dtype == "bfloat16" and p1.shape == [pool.plane_rows, 64]
    assert p0.__dlpack_device__() == (1, 0)
    a = np.from_dlpack(p0)
    assert a.ctypes.data == p0.ptr and a.shape == (pool.plane_rows, 512) and a.dtype == np.uint8
    assert pool.plane(1, dtype="float8_e4m3fn").shape == [pool.plane_rows, 128]
    with pytest.raises(ValueError):
        pool.plane(1, dtype="float64")


@pytest.mark.parametrize(
    "model, dtype, planes",
    [
        ("v4-flash", "fp8", [("uint8", 512), ("bfloat16", 64)]),
        ("v4-flash", "bf16", [("bfloat16", 512)]),
        ("v4-flash", "flashmla-v4", [("uint8", 584)]),
        ("v4.1-flash", "bf16", [("bfloat16", 512)]),
        ("v4.1-flash", "flashmla-v41", [("uint8", 528)]),
        ("v4.1-flash", "flashmla-v41-fp4", [("uint8", 528)]),
    ],
)
def test_view_dtype_is_the_row_formats(model, dtype, planes):
    # defect43 row 9: a FlashMLA pool's plane and layer views were bfloat16 [rows, 292] over
    # packed e4m3 / fp4 bytes. A plane of one bf16 value run is bfloat16; any other is bytes.
    pool = v4pool.Pool(v4pool.plan(model=model, budget="1GiB", max_seqs=4, dtype=dtype), backend="host")
    layer = next(i for i, r in enumerate(pool.ratios) if r > 0)
    for plane, (name, cols) in enumerate(planes):
        for v in (pool.plane(plane), pool.layer_view(layer, plane)):
            assert (v.dtype, v.shape[1]) == (name, cols), (dtype, plane)
        if name == "uint8":
            a = np.from_dlpack(pool.plane(plane))
            assert a.dtype == np.uint8 and a.shape == (pool.plane_rows, cols)


def test_page_view_refuses_a_page_larger_than_the_plane(pool):
    # defect43 row 11: Ok with 0 pages and a [0, 2^63 - 1, 1, 512] view numpy could not take.
    for rows in (2**63 - 1, pool.plane_rows + 1):
        with pytest.raises(v4pool.V4PoolError) as e:
            pool.page_view(0, 0, rows)
        assert e.value.variant == "NotPageable"
    view, shift = pool.page_view(0, 0, 64)
    assert view.shape[0] >= 1 and shift >= 0


def test_window_rows_alias_the_planes(pool, plan):
    """Write through numpy at a slot's window rows, read back through the pool at the byte
    offsets the geometry gives; then the other way round."""
    slot = pool.alloc_slot()
    ring = plan.ring_slots
    for ratio in (0, 4, 128):
        layer = layer_of(pool, ratio)
        for plane, width in enumerate(pool.plane_widths):
            view = np.from_dlpack(pool.layer_view(layer, plane, dtype="uint8"))
            base = pool.layer_view(layer, plane).ptr - pool.plane(plane).ptr
            assert base == pool.absolute_row(layer, 0) * width
            for ring_pos in RNG.choice(ring, size=4, replace=False):
                row = pool.window_index(layer, slot.position, int(ring_pos))
                data = RNG.integers(0, 256, size=width, dtype=np.uint8)
                view[row] = data
                offset = pool.absolute_row(layer, row) * width
                assert pool.read_plane(plane, offset, width) == data.tobytes()
                back = RNG.integers(0, 256, size=width, dtype=np.uint8)
                pool.write_plane(plane, offset, back.tobytes())
                assert np.array_equal(view[row], back)


def test_state_views_are_strided_per_position(pool):
    names = pool.state_fields()
    assert names
    f32 = [n for n in names if pool.state_view(n).dtype == "float32"]
    assert f32, names
    slot = pool.alloc_slot()
    seen_neg_inf = False
    for name in f32:
        sv = pool.state_view(name)
        a = np.from_dlpack(sv)
        assert list(a.shape) == sv.shape
        assert [s // 4 for s in a.strides] == sv.strides
        mine = a[:, slot.position]
        # Initialised on allocation: zeros, or -inf for score fields.
        assert np.all((mine == 0) | np.isneginf(mine))
        seen_neg_inf |= bool(np.isneginf(mine).any())
        # A write through the state view lands inside the slot's own rows.
        mine[...] = 1.5
        assert np.all(a[:, slot.position] == 1.5)
    assert seen_neg_inf, "no score field initialised to -inf"


def test_views_keep_the_pool_alive(plan):
    pool = v4pool.Pool(plan, backend="host")
    a = np.from_dlpack(pool.plane(0))
    a[3, :4] = [1, 2, 3, 4]
    ptr = pool.plane(0).ptr
    del pool
    gc.collect()
    assert a.ctypes.data == ptr
    assert list(a[3, :4]) == [1, 2, 3, 4]


def test_boundary_moves_keep_view_addresses(pool):
    before = [pool.layer_view(layer_of(pool, r), 0).ptr for r in (0, 4, 128)]
    counts = pool.counts()
    change = pool.grow_slots(1)
    assert change["num_slots"] == counts["num_slots"] + 1
    assert pool.counts()["num_slots"] == counts["num_slots"] + 1
    assert before == [pool.layer_view(layer_of(pool, r), 0).ptr for r in (0, 4, 128)]
    pool.shrink_slots(1)
    with pytest.raises(v4pool.V4PoolError) as e:
        pool.shrink_slots(10**6)
    assert e.value.variant


def test_checkpoint_round_trip(pool):
    slot = pool.alloc_slot()
    layer = layer_of(pool, 4)
    view = np.from_dlpack(pool.layer_view(layer, 0))
    row = pool.window_index(layer, slot.position, 7)
    view[row] = RNG.integers(0, 256, size=512, dtype=np.uint8)
    saved = view[row].copy()
    layout, data = pool.checkpoint(slot)
    assert layout == pool.plan.layout_id
    view[row] = 0
    pool.restore(slot, layout, data)
    assert np.array_equal(view[row], saved)
    with pytest.raises(v4pool.V4PoolError) as e:
        pool.restore(slot, layout, data[:-1])
    assert e.value.variant == "BufferSize"
    with pytest.raises(v4pool.V4PoolError) as e:
        pool.restore(slot, "another-layout", data)
    assert e.value.variant


# ---- decode index buffers ----------------------------------------------------------------


def test_decode_build_matches_the_geometry(pool, plan):
    slots = [pool.alloc_slot() for _ in range(3)]
    blocks = [pool.alloc_block() for _ in range(12)]
    bs = 256
    dec = pool.decode(max_seqs=4, max_blocks_per_seq=4)
    cap = dec.capacity()
    assert cap["win"] == 128 and cap["max_tokens"] == 4
    ctx = np.array([5, 700, 1000], dtype=np.int64)
    positions = np.array([s.position for s in slots], dtype=np.int64)
    ids = RNG.permutation([b.id for b in blocks]).astype(np.int32)
    tables = np.zeros((3, 4), dtype=np.int32)
    tables[:] = ids[:12].reshape(3, 4)
    # Poison the outputs: every cell the build owns must be written.
    for cls in ("dense", "csa", "hca"):
        np.from_dlpack(dec.indices(cls))[:] = -7
    tokens = dec.stage(positions, ctx, block_tables=tables)
    assert tokens == 3
    dec.build()
    ring = plan.ring_slots
    for cls, ratio in (("dense", 0), ("csa", 4), ("hca", 128)):
        layer = layer_of(pool, ratio)
        indptr = np.from_dlpack(dec.indptr(cls))
        idx = np.from_dlpack(dec.indices(cls))
        dest = np.from_dlpack(dec.dest_rows(cls))
        expect_ptr = [0]
        for t, c in enumerate(ctx):
            p = int(c) - 1
            n = min(p + 1, 128)
            head = {"dense": 0, "csa": min((p + 1) // 4, c // 4, cap["index_topk"]), "hca": min((p + 1) // 128, c // 128)}[cls]
            expect_ptr.append(expect_ptr[-1] + head + n)
            end = expect_ptr[-1]
            tail = [pool.window_index(layer, int(positions[t]), (p - n + 1 + i) % ring) for i in range(n)]
            assert list(idx[end - n:end]) == tail, (cls, t)
            assert dest[t] == tail[-1]
            if cls == "hca":
                heads = [pool.compress_index(layer, int(tables[t][e // 2]), e % 2) for e in range(head)]
                assert list(idx[expect_ptr[-2]:expect_ptr[-2] + head]) == heads
        assert list(indptr[:4]) == expect_ptr
        # Pad tokens repeat the last offset.
        assert np.all(indptr[4:] == expect_ptr[-1])


def test_decode_resident_tables_and_errors(pool):
    slot = pool.alloc_slot()
    blk = pool.alloc_block()
    dec = pool.decode(max_seqs=2, max_blocks_per_seq=2)
    dec.write_block_table(0, np.array([blk.id], dtype=np.int32))
    assert dec.stage([slot.position], [300]) == 1  # lists work too (copied)
    dec.build()
    hca = layer_of(pool, 128)
    idx = np.from_dlpack(dec.indices("hca"))
    assert idx[0] == pool.compress_index(hca, blk.id, 0)
    assert idx[1] == pool.compress_index(hca, blk.id, 1)

    def variant(**kw):
        args = dict(positions=[slot.position], context_lens=[10])
        args.update(kw)
        with pytest.raises(v4pool.V4PoolError) as e:
            dec.stage(**args)
        return e.value.variant

    assert variant(positions=[-5]) == "BadPosition"
    assert variant(positions=[slot.position] * 3, context_lens=[10] * 3) == "TooManySeqs"
    assert variant(context_lens=[10, 11]) == "BatchShape"
    assert variant(context_lens=[10**6]) == "ContextTooLong"  # more than 2 columns of blocks
    assert variant(num_tokens=[0]) == "BadSequence"
    with pytest.raises(TypeError):
        dec.stage(np.array([slot.position], dtype=np.int32), [10])
    with pytest.raises(ValueError):
        dec.indices("mla")


def test_decode_views_outlive_their_objects(pool):
    dec = pool.decode(max_seqs=1, max_blocks_per_seq=1)
    a = np.from_dlpack(dec.indptr("dense"))
    a[:] = 42
    del dec, pool
    gc.collect()
    assert np.all(a == 42)


# ---- a pool over engine memory -----------------------------------------------------------


def test_pool_over_numpy_memory(plan):
    need = v4pool.Pool.required_bytes(plan)
    mem = np.full(need + 300, 0xAB, dtype=np.uint8)
    pool = v4pool.Pool(plan, backend="host", memory=mem)
    start, length = pool.region
    assert mem.ctypes.data <= start < mem.ctypes.data + 256 and length <= mem.nbytes
    p0 = pool.plane(0)
    off = p0.ptr - mem.ctypes.data
    assert 0 <= off < mem.nbytes
    # The planes were zeroed on allocation (outside the slots' initialised state).
    assert not mem[off:off + 512].any()
    pool.write_plane(0, 1024, bytes(range(16)))
    assert list(mem[off + 1024:off + 1040]) == list(range(16))
    # A slot's state initialisation writes into the engine's bytes too.
    slot = pool.alloc_slot()
    layer = layer_of(pool, 4)
    row = pool.window_index(layer, slot.position, 0)
    plane_row = pool.absolute_row(layer, row)
    np.from_dlpack(pool.layer_view(layer, 0))[row, :3] = [9, 8, 7]
    assert list(mem[off + plane_row * 512:off + plane_row * 512 + 3]) == [9, 8, 7]
    del pool
    gc.collect()


def test_pool_over_too_little_memory(plan):
    mem = np.zeros(1 << 20, dtype=np.uint8)
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.Pool(plan, backend="host", memory=mem)
    assert e.value.variant == "RegionTooSmall"
    with pytest.raises(ValueError):
        v4pool.Pool(plan, backend="host", memory=np.zeros(10**8, dtype=np.uint8)[::2])


def test_pool_memory_comes_through_dlpack_only(plan):
    # A raw address from Python cannot be checked: there is no `over_pointer` any more.
    assert not hasattr(v4pool.Pool, "over_pointer")

# ---- FlashMLA operands of a decode object -------------------------------------------------

MTP = 2  # tokens per sequence: FlashMLA's s_q


def _flash_step(pool, plan, ctx, dec_kwargs=None):
    """A FlashMLA-mode `Decode` staged and built for sequences of `ctx` (MTP tokens each) on
    fresh slots and random block tables; returns (dec, positions, tables, token positions)."""
    slots = [pool.alloc_slot() for _ in ctx]
    cols = max(-(-c // 256) for c in ctx)
    blocks = [pool.alloc_block() for _ in range(len(ctx) * cols)]
    ids = RNG.permutation([b.id for b in blocks]).astype(np.int32)
    tables = ids.reshape(len(ctx), cols)
    dec = pool.decode(max_seqs=len(ctx) + 1, max_blocks_per_seq=cols, flashmla=True, **(dec_kwargs or {}))
    positions = np.array([s.position for s in slots], dtype=np.int64)
    dec.stage(positions, np.array(ctx, dtype=np.int64), [MTP] * len(ctx), tables)
    dec.build()
    pos = [c - MTP + j for c in ctx for j in range(MTP)]
    return dec, positions, tables, pos


@pytest.fixture(scope="module")
def flash_plan():
    return v4pool.plan(model="v4-flash", budget="512MiB", max_seqs=4, dtype="flashmla-v4", spec_steps=MTP - 1)


def test_flashmla_csa_part_is_packed_on_the_decode_object(flash_plan):
    # defect43 row 16: after build, a CSA layer's compressed part was zeros (row 0, a valid
    # row) with length 0 and `Decode` had no pack. Each build now resets it to -1 with length 0
    # (an unpacked layer can't pass for rows, nor show the last step's), and `csa_pack` fills
    # it from the indexer's top-k (checked, as `Forward.decode_csa_pack`).
    pool = v4pool.Pool(flash_plan, backend="host")
    ctx = [700, 1500, 2100]
    dec, positions, tables, pos = _flash_step(pool, flash_plan, ctx)
    csa = layer_of(pool, 4)
    ops = dec.flashmla(csa)
    ex, el = np.from_dlpack(ops["extra_indices"]), np.from_dlpack(ops["extra_topk_length"])
    T, W = el.shape[0], ex.shape[1]
    assert ex.shape == (T, W)
    assert np.all(ex == -1) and np.all(el == 0), "an unpacked CSA part looks like rows"
    topk_w = dec.capacity()["index_topk"]
    topk = np.full((len(pos), topk_w), -1, dtype=np.int32)
    for t, p in enumerate(pos):
        entries = (p + 1) // 4
        head = min(entries, topk_w)
        topk[t, :head] = RNG.choice(entries, size=head, replace=False)
    dec.csa_pack(topk)
    for t, p in enumerate(pos):
        b, head = t // MTP, min((p + 1) // 4, topk_w)
        want = [pool.compress_index(csa, int(tables[b][e // 64]), e % 64) + ops["shift"] for e in topk[t, :head]]
        assert el[t] == head and list(ex[t, :head]) == want, t
        assert np.all(ex[t, head:] == -1)
    assert np.all(ex[len(pos):] == -1) and np.all(el[len(pos):] == 0), "pads"
    dec.build()
    assert np.all(ex == -1) and np.all(el == 0), "a build keeps the last step's CSA rows"
    with pytest.raises(v4pool.V4PoolError) as e:
        dec.csa_pack(np.full((len(pos), topk_w), 10**6, dtype=np.int32))
    assert e.value.variant


def test_flashmla_lengths_per_batch_entry(flash_plan):
    # defect43 row 17: FlashMLA takes topk_length / extra_topk_length per batch entry ([B],
    # shared by the entry's s_q tokens); v4pool gave them per token. `seq_topk_length` /
    # `seq_extra_topk_length` are FlashMLA's: each sequence's longest (its last token's), pads 0,
    # and every token's row is -1 from its own length on, so the shared length is exact.
    pool = v4pool.Pool(flash_plan, backend="host")
    ctx = [300, 1500, 2100]
    dec, positions, tables, pos = _flash_step(pool, flash_plan, ctx)
    cap = dec.capacity()
    B = cap["max_seqs"]
    topk = np.full((len(pos), cap["index_topk"]), -1, dtype=np.int32)
    for t, p in enumerate(pos):
        topk[t, : min((p + 1) // 4, cap["index_topk"])] = 0
    dec.csa_pack(topk)
    for ratio in (0, 4, 128):
        ops = dec.flashmla(layer_of(pool, ratio))
        sl = np.from_dlpack(ops["seq_topk_length"])
        want = [min(c, cap["win"]) for c in ctx] + [0] * (B - len(ctx))
        assert sl.shape == (B,) and list(sl) == want, ratio
        idx = np.from_dlpack(ops["indices"])[: B * MTP].reshape(B, MTP, -1)
        tl = np.from_dlpack(ops["topk_length"])[: B * MTP].reshape(B, MTP)
        assert list(tl.max(1)) == want
        for b in range(B):
            for j in range(MTP):
                assert np.all(idx[b, j, tl[b, j]:] == -1), (ratio, b, j)
        if ratio == 0:
            assert "seq_extra_topk_length" not in ops
            continue
        sel = np.from_dlpack(ops["seq_extra_topk_length"])
        per = {4: lambda c: min(c // 4, cap["index_topk"]), 128: lambda c: c // 128}[ratio]
        assert list(sel) == [per(c) for c in ctx] + [0] * (B - len(ctx)), ratio
        etl = np.from_dlpack(ops["extra_topk_length"])[: B * MTP].reshape(B, MTP)
        assert list(etl.max(1)) == list(sel), ratio


def test_step_cost_is_the_calibrated_model():
    # benches/vllm_trace.py times vLLM's scheduler with it: the coefficients `v4pool calibrate`
    # fits, the formula StepCost::step_ms's.
    c = v4pool.StepCost.preset("h200x4-flash-fp8")
    k = json.loads(c.to_json())
    assert c.name == "h200x4-flash-fp8" and c.gpus == 4
    assert c.step_ms() == k["base_ms"]
    load = dict(prefill_tokens=2048, prefill_ctx_tokens=2048 * 5000.0, decode_seqs=30,
                decode_ctx_tokens=30 * 9000, restored_bytes=3 << 20)
    assert c.step_ms(**load) == pytest.approx(
        k["base_ms"] + k["per_seq_ms"] * 30 + k["per_kv_token_ms"] * 30 * 9000
        + k["per_prefill_token_ms"] * (2048 + k["prefill_ctx"] * 2048 * 5000.0)
        + (3 << 20) / (k["host_gbps"] * 1e6), rel=1e-12)
    # serde_json's float parsing may round the last bit (src/sim/cost.rs tests say the same).
    back = json.loads(v4pool.StepCost.from_json(c.to_json()).to_json())
    assert back == {n: pytest.approx(v, rel=1e-15) if isinstance(v, float) else v for n, v in k.items()}
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.StepCost.preset("h100x1-nothing")
    assert e.value.variant == "UnknownPreset"
    with pytest.raises(v4pool.V4PoolError) as e:
        v4pool.StepCost.from_json(json.dumps(dict(k, base_ms=-1.0)))
    assert e.value.variant == "Coefficient"
    cli = os.environ.get("V4POOL_CLI")
    if not cli:
        pytest.skip("V4POOL_CLI not set: no `v4pool` binary to compare with")
    out = subprocess.run([cli, "calibrate", "--preset", "h200x4-flash-fp8", "--no-replay", "--json"],
                         check=True, capture_output=True, text=True).stdout
    assert json.loads(out)["presets"][0]["cost"] == k
