"""The engineering beneath the five scripts (arco.py, env.py, rubric_model.py, warmup.py, evaluate.py): what makes
them run fast, at scale and safely. No function here computes an equation of the paper (tests/test_paper_map.py):
the passes hand the scripts hidden states and log-probs, and compute the KL with the script's own function
(arco.token_kl, on arco.reference). Each module is small and named for its one job, and none imports a script (a
teacher is handed the environment it plays in).

    settings      the engineering settings (data, device, backbones, engines, budgets, folders); from_preset; the
                  command-line helper (the paper's knobs are declared in the scripts)
    memory        the process's memory by phase; glibc's heap handed back; the peak so far
    files         JSON / JSONL I/O, folders written whole, manifests that find a damaged checkpoint, a predictions file
    data          the data files (and their download), MuSiQue's layout, the gold answers, the synthetic worlds
    models        loading (the embedded SmolLM2, HF ids, random shapes), device and dtype, LoRA, checkpoints
    passes        generation, token log-probs, the training passes (hidden states, the caller's KL); the plain engine
    fast          the fast engine: shared prefixes, packing with tree masks, a prompt memo, a cached decoder
    engines       the two engines by --engine's name, and how a script's settings load a model
    estimate      --dry-run's memory estimate from the models' shapes
    parallel      torchrun's processes, injected into Algorithm 1 (one process: nothing happens)
    runs          a run's folder: logs, traces, checkpoints, --resume (its scheme kept), --init-from, Ctrl-C; what an
                  update logs of μ (mu_at_work, auc)
    report        report.md, mu.png, memory.json; markdown tables
    warmups       a warmup folder's names and checks; the SFT-only evaluation a run reuses
    teachers      what the warmup's teachers share: their errors, API workers in parallel, a shared retriever
    oracle        the offline oracle teacher, and π_sft playing with the oracle annotating
    openai_teacher  the OpenAI-compatible teacher
"""
