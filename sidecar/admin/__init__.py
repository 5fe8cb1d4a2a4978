"""The admin side: its own listener, the kill switch, reload, health."""
