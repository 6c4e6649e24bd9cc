"""`pyklei batch`: OpenAI Batch API files run offline through pyklei engines (docs/BATCH.md).

    lines.py       the input and output lines, reproducible ids, where a partial output left off
    engine_run.py  lines through one engine, with the server's request checks and replies
    job.py         input file -> output file: resume, append in order, progress, a summary
    ray_data.py    the same lines on Ray Data, an actor pool of engines (the `ray` extra)
"""
