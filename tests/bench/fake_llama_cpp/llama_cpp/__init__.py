"""A stand-in for llama-cpp-python's package, just enough for bench peers' llama.cpp peer in tests."""
