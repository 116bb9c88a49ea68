"""The engineering beneath the five scripts (arco.py, env.py, rubric_model.py, warmup.py, evaluate.py): what makes
them run fast, at scale and safely. Nothing here is a step of the paper; each module is small and named for its one
job, and none imports a script (a teacher is handed the environment it plays in).

    settings      every setting declared once with its `paper` and `cpu` values; the command-line helper
    memory        the process's memory by phase; glibc's heap handed back; the peak so far
    files         JSON / JSONL I/O, folders written whole, manifests that find a damaged checkpoint
    data          the data files (and their download), MuSiQue's layout, the synthetic worlds
    models        loading (the embedded SmolLM2, HF ids, random shapes), device and dtype, LoRA, checkpoints
    passes        generation, token log-probs and KL, the training passes; the plain engine
    fast          the fast engine: shared prefixes, packing with tree masks, a prompt memo, a cached decoder
    engines       the two engines by --engine's name, and how a script's settings load a model
    estimate      --dry-run's memory estimate from the models' shapes
    parallel      torchrun's processes, injected into Algorithm 1 (one process: nothing happens)
    runs          a run's folder: logs, traces, checkpoints, --resume, --init-from, Ctrl-C
    report        report.md, mu.png, memory.json
    warmups       a warmup folder's names and checks; the SFT-only evaluation a run reuses
    teachers      what the warmup's teachers share (their scores read, their errors)
    oracle        the offline oracle teacher, and π_sft playing with the oracle annotating
    openai_teacher  the OpenAI-compatible teacher
"""
