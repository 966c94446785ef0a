"""``specdec serve``: an OpenAI-compatible HTTP server over one :class:`~specdec_cli.session.Session`.

``protocol`` (request and response shapes, no MLX), ``anthropic`` and
``responses`` (Anthropic's Messages API and OpenAI's Responses API as
translations to chat requests, no MLX), ``service`` (what a request becomes),
``scheduler`` (the generation thread: requests decoded together as rows of one engine), ``app`` (the only module that imports
the web framework) and ``command`` (options, bind, run).
"""
