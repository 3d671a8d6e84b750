// Which sanitizer the code is built under, for the few places that must know:
// KEEL_UNDER_TSAN is 1 in a ThreadSanitizer build (KEEL_TSAN), else 0.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define KEEL_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KEEL_UNDER_TSAN 1
#endif
#endif
#ifndef KEEL_UNDER_TSAN
#define KEEL_UNDER_TSAN 0
#endif
