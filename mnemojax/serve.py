"""`python -m mnemojax.serve --model tiny`: the OpenAI-compatible HTTP server (the command; the server is
`mnemojax.serving.server`, its flags every field of EngineConfig, ServerConfig and MultiHostConfig)."""
from mnemojax.serving.server import run

if __name__ == "__main__":
    run()
