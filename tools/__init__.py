"""Diagnostics and benchmarks of the inference code: the decode, prefill, request, server, kernel and TP-reduction
benchmarks (bench_*) and the offline sm90 SASS report (sass), with what several of them share in one module (rank).
Nothing of the product imports this package. Each tool runs from the repository root as a module, so that the
product's modules (kernel, model, engine, ...) import by their bare names: `python -m tools.bench_request ...`, and
under torchrun, which takes a module with -m (--module) as python does, `torchrun --standalone --nproc-per-node=2 -m
tools.bench_decode --whole-rank`.
"""
