"""Built-in platform plugins, one module each. Registered like third-party plugins.

Each module imports its vendor runtime lazily, inside methods, so importing
the module (which the manager always does) is free and safe everywhere.
"""
