"""Write tests/fixtures/vllm_v4_flash_layout.json: vLLM 0.34's placement of DeepSeek-V4-Flash's
KV cache (groups, page sizes, slab offsets and strides), derived on CPU by vLLM's own
functions (dsv4_layout), for benches/vllm_gpu_restore.py, which runs where vLLM is not
installed. Run in the vLLM venv: python tests/vllm/make_gpu_fixture.py"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dsv4_layout as L  # noqa: E402


def main() -> None:
    from v4pool.vllm import Layout

    cfg = L.vllm_config("v4-flash")
    kcfg = L.kv_cache_config(cfg)
    lay = Layout.of(cfg, kcfg)
    out = {
        "generated_by": "tests/vllm/make_gpu_fixture.py",
        "vllm": "0.34.0",
        "model": "DeepSeek-V4-Flash (tests/fixtures/vllm/v4-flash/config.json)",
        "hash_block": lay.block,
        "num_blocks": kcfg.num_blocks,
        "layout_id": lay.layout_id,
        "groups": [
            {"idx": g.idx, "role": g.role, "block_size": g.block_size, "window": g.window,
             "spec_kind": g.spec_kind, "layers": list(g.layers), "page_bytes": list(g.page_bytes)}
            for g in lay.groups
        ],
        "tensors": [
            {"size": t.size, "layers": list(t.layers), "layer_stride": t.layer_stride,
             "block_stride": t.block_stride, "offset": t.offset}
            for t in kcfg.kv_cache_tensors
        ],
    }
    dst = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_v4_flash_layout.json"
    dst.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
