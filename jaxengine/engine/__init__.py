"""The engine: scheduler + executor + output processing, stepped by its caller."""
