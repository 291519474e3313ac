"""Text-to-SQL with LangGraph (writer → checker → rewriter), trained with LightningRL: see README.md."""
