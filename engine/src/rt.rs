//! rt (under construction)
