"""The engine side: the one thread that runs the model, and what it needs.

``engine`` (the thread, ``step() = schedule -> run -> postprocess``),
``scheduler`` (queues, intake, expiry, admission), ``runner`` (prefill and
batched decode), ``output`` (detokenize, stop strings, events), ``protocol``
(the records routes and engine exchange). Nothing here imports FastAPI or
knows HTTP status codes.
"""
