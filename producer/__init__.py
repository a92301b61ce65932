"""pagedq's client side. Never imports torch (a test asserts it)."""
