"""Will it fit, and how long will a step take: everything that sizes a run.

Where things are:
  compile.py        `--mode=compile`: the train (or eval) step compiled for a
                    named TPU slice or GPU node (`compile_devices`), its
                    memory_analysis, FLOPs and step-time figures, written to
                    compile.json (`run_compile`);
  tpu.py            compile-only TPU slices (libtpu: `topology_devices`);
  gpu.py            compile-only GPU nodes (the CUDA plugin: the GPU specs it
                    compiles for, `gpu_topology_devices`);
  devices.py        the environment those two libraries read, set once
                    (`compile_only_env`);
  hlo_flops.py      FLOPs and collective bytes counted from optimised HLO;
  memory_model.py   the analytic per-device memory of one train step
                    (coefficients: lctx/parallel/memory_coefficients.json,
                    written by scripts/fit_memory_model.py);
  step_estimate.py  the analytic step-time estimate;
  planner.py        `--mode=plan`: the memory model over a search of setups,
                    written to plan.json (`run_plan`).
Hardware facts (HBM, host RAM, peak FLOP/s) are in lctx/hardware.py. The
strategy a run takes is decided in lctx/parallel/auto.py (`decide_strategy`),
which the planner asks too.
"""
