"""The engine side: the one thread that runs the model, and what it needs.

``engine`` (the thread and its loop), ``startup`` (the parts built once the
model is loaded), ``steps`` (one step = schedule -> run -> postprocess, and
every request's end), ``scheduler`` (queues, intake, expiry, admission),
``runner`` (prefill and batched decode), ``output`` (detokenize, stop strings,
events), ``protocol`` (the records routes and engine exchange). Nothing here imports FastAPI or
knows HTTP status codes.
"""
