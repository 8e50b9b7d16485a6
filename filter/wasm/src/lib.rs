//! glue
