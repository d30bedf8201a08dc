"""Engine code written only against the platform API (the one-way rule: no vendor names)."""
