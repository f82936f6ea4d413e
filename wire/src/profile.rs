//! Protocol profile lookups shared by both sides (U3, U4): the Edge binds a
//! credential lease to the path the Node will resolve, so both resolve an
//! operation through this one table.

use crate::pb::ProtocolProfile;

/// The profile operations a tunnel may name (U3).
pub const OPERATIONS: [&str; 14] = [
    "models",
    "chat_completions",
    "messages",
    "count_tokens",
    "responses",
    "completions",
    "embeddings",
    "rerank",
    "score",
    "tokenize",
    "detokenize",
    "transcriptions",
    "translations",
    "speech",
];

impl ProtocolProfile {
    /// The configured path of `operation` (possibly empty: the profile has
    /// none), or `None` when `operation` is not a profile operation.
    pub fn operation_path(&self, operation: &str) -> Option<&str> {
        let path = match operation {
            "models" => &self.models_path,
            "chat_completions" => &self.chat_completions_path,
            "messages" => &self.messages_path,
            "count_tokens" => &self.count_tokens_path,
            "responses" => &self.responses_path,
            "completions" => &self.completions_path,
            "embeddings" => &self.embeddings_path,
            "rerank" => &self.rerank_path,
            "score" => &self.score_path,
            "tokenize" => &self.tokenize_path,
            "detokenize" => &self.detokenize_path,
            "transcriptions" => &self.transcriptions_path,
            "translations" => &self.translations_path,
            "speech" => &self.speech_path,
            _ => return None,
        };
        Some(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_has_its_own_path() {
        let profile = ProtocolProfile {
            models_path: "/m".into(),
            chat_completions_path: "/c".into(),
            messages_path: "/ms".into(),
            count_tokens_path: "/ct".into(),
            responses_path: "/r".into(),
            completions_path: "/co".into(),
            embeddings_path: "/e".into(),
            rerank_path: "/rr".into(),
            score_path: "/s".into(),
            tokenize_path: "/t".into(),
            detokenize_path: "/d".into(),
            transcriptions_path: "/at".into(),
            translations_path: "/al".into(),
            speech_path: "/as".into(),
            ..Default::default()
        };
        let paths: Vec<_> = OPERATIONS
            .iter()
            .map(|op| profile.operation_path(op))
            .collect();
        assert_eq!(
            paths,
            [
                Some("/m"),
                Some("/c"),
                Some("/ms"),
                Some("/ct"),
                Some("/r"),
                Some("/co"),
                Some("/e"),
                Some("/rr"),
                Some("/s"),
                Some("/t"),
                Some("/d"),
                Some("/at"),
                Some("/al"),
                Some("/as")
            ]
        );
        assert_eq!(profile.operation_path("images"), None);
        assert_eq!(profile.operation_path("v2_rerank"), None);
        assert_eq!(
            ProtocolProfile::default().operation_path("models"),
            Some("")
        );
    }
}
