"""User-space probes: specs, and the engines that place them (xol, uprobe, frida)."""
