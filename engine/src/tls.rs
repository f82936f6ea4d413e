//! tls (under construction)
