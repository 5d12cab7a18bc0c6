"""kvtrace: flight recorder and wind tunnel for hybrid LLM prefix caches."""
__version__ = "0.1.0"
