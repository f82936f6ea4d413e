//! conn (under construction)
