"""Makes this folder a package so pytest does not put it on sys.path, where its crewai/, openai/,
autogen/ and langchain/ folders would shadow (as namespace packages) frameworks that are not installed."""
