// Frames for the placard: the camera (getUserMedia, a chosen device) or an uploaded file, each
// downscaled to at most `maxSide` pixels on the long side and encoded as JPEG.

export const JPEG_QUALITY = 0.85;
// Mean luma (0-255) below which a frame is taken for a covered lens or a dark room and skipped:
// a classifier labels black frames confidently and wrongly.
export const DARK_LUMA = 16;

export class CameraError extends Error {
  constructor(message, reason) {
    super(message);
    this.name = "CameraError";
    this.reason = reason; // "denied" | "missing" | "busy" | "unsupported"
  }
}

function cameraError(err) {
  switch (err?.name) {
    case "NotAllowedError":
    case "SecurityError":
      return new CameraError("Camera access was denied. Upload a photo instead, or allow the camera and reload.", "denied");
    case "NotFoundError":
    case "OverconstrainedError":
      return new CameraError("No camera was found. Upload a photo instead.", "missing");
    case "NotReadableError":
    case "AbortError":
      return new CameraError("The camera is in use by another program. Close it, or upload a photo.", "busy");
    default:
      return new CameraError(`The camera could not be started (${err?.message ?? err}). Upload a photo instead.`, "busy");
  }
}

export async function openCamera(deviceId) {
  if (!navigator.mediaDevices?.getUserMedia) {
    throw new CameraError("This page cannot use a camera here (browsers allow it on https and localhost only). Upload a photo instead.", "unsupported");
  }
  const video = { width: { ideal: 640 }, height: { ideal: 480 } };
  if (deviceId) video.deviceId = { exact: deviceId };
  try {
    return await navigator.mediaDevices.getUserMedia({ video, audio: false });
  } catch (err) {
    throw cameraError(err);
  }
}

// Labels are only readable after permission was granted, so list after openCamera.
export async function listCameras() {
  const devices = await navigator.mediaDevices.enumerateDevices();
  return devices
    .filter((d) => d.kind === "videoinput")
    .map((d, i) => ({ deviceId: d.deviceId, label: d.label || `Camera ${i + 1}` }));
}

function scaledCanvas(source, width, height, maxSide) {
  const scale = Math.min(1, maxSide / Math.max(width, height));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(width * scale));
  canvas.height = Math.max(1, Math.round(height * scale));
  canvas.getContext("2d").drawImage(source, 0, 0, canvas.width, canvas.height);
  return canvas;
}

// The video's current frame, or null while it has none yet.
export function grabFrame(video, maxSide) {
  if (video.readyState < 2 || !video.videoWidth) return null;
  return scaledCanvas(video, video.videoWidth, video.videoHeight, maxSide);
}

export async function fileToCanvas(file, maxSide) {
  if (!file.type.startsWith("image/")) throw new Error(`${file.name || "that file"} is not an image`);
  let bitmap;
  try {
    bitmap = await createImageBitmap(file);
  } catch {
    throw new Error(`${file.name || "that file"} could not be decoded as an image`);
  }
  try {
    return scaledCanvas(bitmap, bitmap.width, bitmap.height, maxSide);
  } finally {
    bitmap.close();
  }
}

// Mean Rec. 601 luma over a 32x32 thumbnail: cheap, and enough to tell a black frame.
export function meanLuma(canvas) {
  const small = scaledCanvas(canvas, canvas.width, canvas.height, 32);
  const { data } = small.getContext("2d").getImageData(0, 0, small.width, small.height);
  let sum = 0;
  for (let i = 0; i < data.length; i += 4) sum += 0.299 * data[i] + 0.587 * data[i + 1] + 0.114 * data[i + 2];
  return sum / (data.length / 4);
}

export function toJpegDataUrl(canvas) {
  return canvas.toDataURL("image/jpeg", JPEG_QUALITY);
}
