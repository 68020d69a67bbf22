"""The broker's core: publish path, dispatch of the commit feed, subscription router,
retained messages and the session registry."""
