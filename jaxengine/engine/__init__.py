"""The engine: scheduler + runner + output processing, stepped by its caller."""
