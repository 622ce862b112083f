"""Remote references: the RRef class, its ownership protocol and its messages."""
