"""The OpenAI-compatible server: the app (`app.build_app`), its endpoints (`completions`, `chat`) over a shared
base (`base`), request bodies (`protocol`) and Prometheus metrics (`metrics`). `python -m mnemojax.serve` runs
it."""
