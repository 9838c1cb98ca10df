"""Test doubles: fixture host trees (sysfs, debugfs, /proc), a LACT daemon on a real Unix socket,
monitored hosts with fake replicas and fleets, a fake OpenAI server. Never shipped in the wheel."""
