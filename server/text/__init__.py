"""Between text and token ids: chat templates, prompt checks and tokenizing, think
tags, token bytes, and structured-output grammars.

No MLX and no engine state: the engine and the HTTP routes both call in here.
"""
