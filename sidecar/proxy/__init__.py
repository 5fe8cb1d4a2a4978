"""The proxy: a thin aiohttp handler around pure routing and header rules."""
