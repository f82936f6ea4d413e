//! http (under construction)
