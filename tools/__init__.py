"""Tooling outside the runtime: benchmarks (``bench``: step times in one process; ``server_bench``:
whole images through real ComfyUI servers, with ``bench_workflows`` and ``server_processes``), the
random-weight generator (and its GGUF writer) and a reference sampler for tests. The runtime
(``zimage_core``, the nodes) never imports from here.

    python3 -m tools bench --weights W [--simulate-card-gib 7.5] [--resident]
    python3 -m tools random-weights OUT [--layers 30] [--dtype bf16] [--device cuda]
    python3 -m tools gguf-weights SRC OUT.gguf [--quant Q8_0]
    python3 tools/server_bench.py --comfy COMFYUI --weights DIR ...
"""
