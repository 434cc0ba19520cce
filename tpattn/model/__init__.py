"""A small decoder LM on the book's attention block: dense, and tensor-parallel on ranks."""
