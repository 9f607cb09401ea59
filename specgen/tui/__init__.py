"""``specgen-chat``: a Textual chat that colours each token by how speculative decoding produced it.

Modules: ``app`` (the App, keys, threading), ``reply`` (chat widgets, token
colours), ``panel`` (side panel), ``session`` (history and the streaming loop,
no Textual), ``tally`` (running numbers for the panel). Styles: ``chat.tcss``.
"""
