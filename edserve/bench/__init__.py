"""``edserve bench``: a benchmark client for OpenAI-compatible audio servers.

``load`` reads the audio and plans arrivals, ``client`` sends the requests (httpx, async),
``report`` turns the results (and the server's stage histograms, when it has them) into the
printed summary and the ``--json`` document, ``cli`` wires the flags.
"""
