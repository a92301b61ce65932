"""The inference engine. Never imports redis (a test asserts it)."""
